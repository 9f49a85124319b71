"""The run configuration: one typed tree, validated at construction.

Every default of the product lives here and nowhere else. The package imports only pydantic and
PyYAML so that a flow can validate a config on any worker without torch, Megatron or SGLang
(validation also reads the verifiers' and feedback classes' signatures and the credential rules of
`storage.credentials`).

A config is loaded from YAML plus dotted overrides::

    cfg = load_config("configs/demo.yaml", ["loss.alpha=0.5", "rollout.group_size=4"])

Errors name the field (with file:line for a value from the YAML file) and say what to change; a
key given twice in one mapping of the file is refused with both lines (YAML would keep the last).
Every float must be finite. Credentials are refused by allow-list: every URL field holds no user,
query or fragment, free-form mappings hold only the names the product knows (`urls.py`), and
credential-looking keys and values (however spelled) are refused while loading, before the config
is validated, printed or handed to anything; the error names the key, never the value. Storage
options are an allow-list of those that are not secrets (`StorageOptions`), kept out of every record.

The tree is split by what its values decide: `experiment` and `learning` (everything that can change
the result: what is sampled, and how the run learns from it),
`operations` (where a run lives, runs and what it keeps), `run` (the root `RunConfig`, loading,
dumping, hashing) and `source` (the YAML file, overrides and the checks before validation). This
package exports the whole tree: callers import from `tasks.config`.
"""

from tasks.config.experiment import (
    BootstrapConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    SGLangConfig,
    VerifierConfig,
)
from tasks.config.learning import (
    EvalConfig,
    LossConfig,
    OptimizerConfig,
    PipelineConfig,
    TeacherConfig,
    TestTimeConfig,
    TrainConfig,
)
from tasks.config.operations import (
    KeepRuleConfig,
    LaunchConfig,
    RetentionConfig,
    StageLaunch,
    StorageConfig,
    StorageOptions,
    TrackingConfig,
)
from tasks.config.run import (
    RunConfig,
    apply_overrides,
    build_config,
    config_hash,
    flatten,
    full_dict,
    load_config,
    parse_storage_options,
    refuse_flow_overrides,
    stored_tree,
    to_dict,
)
from tasks.config.source import ConfigError

__all__ = [
    "BootstrapConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "KeepRuleConfig",
    "LaunchConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RetentionConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangConfig",
    "StageLaunch",
    "StorageConfig",
    "StorageOptions",
    "TeacherConfig",
    "TestTimeConfig",
    "TrackingConfig",
    "TrainConfig",
    "VerifierConfig",
    "apply_overrides",
    "build_config",
    "config_hash",
    "flatten",
    "full_dict",
    "load_config",
    "parse_storage_options",
    "refuse_flow_overrides",
    "stored_tree",
    "to_dict",
]
