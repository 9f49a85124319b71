"""The whole run's config (`RunConfig`, with its cross-section checks) and how it is loaded from
YAML plus dotted overrides, dumped, hashed and flattened."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from tasks.config.experiment import (
    DataConfig,
    ModelConfig,
    RolloutConfig,
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
from tasks.config.operations import LaunchConfig, StorageConfig, StorageOptions, TrackingConfig
from tasks.config.section import Section
from tasks.config.source import (
    CREDENTIALS_GO,
    MAX_DEPTH,
    ConfigError,
    parse_value,
    read_yaml,
    refuse_credentials,
    where,
)

MAX_NAME_CHARS = 100  # a test-time run's children add a suffix, within the 128 a run folder's name may have
# What a local root holds beside its runs (the default MLflow store, SQLite's files beside it, the
# artifacts): no run folder may take these names.
RESERVED_RUN_NAMES = re.compile(r"^(mlflow\.db.*|mlartifacts)$")


class RunConfig(Section):
    """A whole SDPO (or baseline) run."""

    name: str = Field(
        "demo",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description=f"the run: its folder under storage.root, its MLflow run, its Prefect flow runs; at most "
        f"{MAX_NAME_CHARS} characters",
    )
    seed: int = Field(0, description="seeds the prompt order, sampling, mini-batches and the model's initialisation")
    iterations: int = Field(10, ge=1, description="iterations the run trains; it is complete after the last")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    verifier: VerifierConfig = VerifierConfig()
    rollout: RolloutConfig = RolloutConfig()
    teacher: TeacherConfig = TeacherConfig()
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    storage: StorageConfig = StorageConfig()
    tracking: TrackingConfig = TrackingConfig()
    eval: EvalConfig = EvalConfig()
    pipeline: PipelineConfig = PipelineConfig()
    test_time: TestTimeConfig = TestTimeConfig()
    launch: LaunchConfig = LaunchConfig()

    @field_validator("name")
    @classmethod
    def _usable_name(cls, name: str) -> str:
        if len(name) > MAX_NAME_CHARS:
            raise ValueError(
                f"a run name of {len(name)} characters; give one of at most {MAX_NAME_CHARS} (it names the run's "
                "folder, its MLflow run and flow runs, and the runs a test-time run starts)"
            )
        if RESERVED_RUN_NAMES.match(name):
            raise ValueError(
                f"{name!r} is what a run root holds beside its runs (the MLflow store and its artifacts); pick another name"
            )
        return name

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        uses_distillation = self.loss.type in ("sdpo", "blend", "srpo")
        if uses_distillation and self.teacher.feedback in ("sdpo", "sdpo_relax") and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size} with loss.type={self.loss.type!r} and "
                f"teacher.feedback={self.teacher.feedback!r}: SDPO takes demonstrations from peers in the "
                "group; set rollout.group_size >= 2 (the paper uses 8)"
            )
        if self.data.source == "easy_code" and self.verifier.name != "code":
            raise ValueError(
                f"data.source='easy_code' is judged by running the answers' functions against their tests; "
                f"verifier.name={self.verifier.name!r} cannot read those labels: set verifier.name=code"
            )
        if self.rollout.engine == "sglang" and self.loss.divergence == "full":
            raise ValueError(
                "loss.divergence='full' records the whole vocabulary per token, which SGLang would send "
                "as JSON; use divergence=topk_tail with rollout.engine=sglang"
            )
        if self.loss.type == "srpo" and self.teacher.feedback in ("opd", "opsd"):
            raise ValueError(
                f"loss.type='srpo' routes a failed sample to SDPO when its teacher was shown a successful sibling "
                f"or feedback, which teacher.feedback={self.teacher.feedback!r} never shows; "
                "set teacher.feedback=sdpo (or sdpo_relax)"
            )
        if self.loss.type in ("grpo", "blend", "srpo") and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: GRPO advantages need groups of >= 2 answers"
            )
        if self.launch.teacher.launcher == "torchrun" and self.teacher.backend != "megatron":
            raise ValueError(
                "launch.teacher.launcher='torchrun' needs teacher.backend='megatron' (the HF scorer runs in one process)"
            )
        for stage in ("teacher", "train"):
            spec = getattr(self.launch, stage)
            world = spec.nproc_per_node * spec.nnodes
            if spec.launcher == "torchrun" and world % self.train.tensor_parallel:
                raise ValueError(
                    f"launch.{stage}: {world} ranks are not a multiple of train.tensor_parallel={self.train.tensor_parallel}"
                )
        if not self.eval.enabled:
            for kind in ("resumable", "weights"):
                rule = getattr(self.storage.retention, kind)
                if rule.best is not None:
                    raise ValueError(
                        f"storage.retention.{kind}.best={rule.best!r} ranks iterations by an evaluation, but "
                        "eval.enabled=false runs none; remove the rule or set eval.enabled=true"
                    )
        per_iter = self.data.prompts_per_iteration * self.rollout.group_size
        if per_iter % self.train.steps_per_iteration:
            raise ValueError(
                f"train.steps_per_iteration={self.train.steps_per_iteration} does not divide the "
                f"{per_iter} samples of an iteration (data.prompts_per_iteration * rollout.group_size)"
            )
        return self


# --------------------------------------------------------------------------------------------
# loading


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _parse_override(item: str, index: int) -> tuple[str, Any]:
    """(dotted key, value) of override number `index` (`key.sub=value`, the value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {index} ({item[:200]!r}) is not of the form section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {index} ({item[:200]!r}) has an empty key")
    source = f"override {index} ({key[:80]})"
    if key.count(".") + 1 > MAX_DEPTH:
        raise ConfigError(f"{source}: a key of {key.count('.') + 1} levels; a run config nests at most {MAX_DEPTH}")
    return key, parse_value(raw, source=source, depth=key.count(".") + 1) if raw.strip() else ""


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `tree` with `key.sub=value` overrides applied (values parsed as YAML)."""
    out = json.loads(json.dumps(tree))
    for i, item in enumerate(overrides, start=1):
        _set_dotted(out, *_parse_override(item, i))
    return out


def _error_lines(err: ValidationError, lines_of: dict[str, str], *, prefix: str = "") -> list[str]:
    lines = []
    for e in err.errors():
        loc = ".".join([prefix, *map(str, e["loc"])] if prefix else map(str, e["loc"])) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        if loc.startswith("storage.storage_options") and CREDENTIALS_GO not in msg:
            msg += "; " + CREDENTIALS_GO  # a wrong-shaped option may be a credential put there
        place = where(lines_of, loc)
        lines.append(f"  {place + ': ' if place else ''}{loc}: {msg}")
    return lines


def _format_validation_error(err: ValidationError, lines_of: dict[str, str]) -> str:
    return "invalid run config:\n" + "\n".join(_error_lines(err, lines_of))


def build_config(tree: dict[str, Any], *, lines_of: dict[str, str] | None = None) -> RunConfig:
    """Validate a plain dict into a RunConfig, raising ConfigError with one line per bad field.

    `lines_of` maps dotted keys to the "file:line" they were read from (named in the errors)."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, lines_of or {})) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config (or the defaults when `path` is None) and apply dotted overrides.

    Credentials are refused (file and overrides) before anything else looks at the values."""
    tree: dict[str, Any] = {}
    lines_of: dict[str, str] = {}
    if path is not None:
        tree, lines_of = read_yaml(Path(path))
    refuse_credentials(tree, places=lines_of)
    parsed = [_parse_override(item, i) for i, item in enumerate(overrides or [], start=1)]
    for i, (key, value) in enumerate(parsed, start=1):
        alone: dict[str, Any] = {}
        _set_dotted(alone, key, value)
        refuse_credentials(alone, places={key: f"override {i} ({key})"})
        lines_of[key] = f"override {i}"  # the value now comes from the override, not the file
    for key, value in parsed:
        _set_dotted(tree, key, value)
    return build_config(tree, lines_of=lines_of)


def refuse_flow_overrides(overrides: list[str], *, config_path: str | Path | None = None) -> None:
    """ConfigError for a command's parameters that Prefect may not store: they become the parameters
    of its flow run. Storage options are refused among the overrides, and the parameters pass the
    scanner every record passes (`storage.credentials.check_record`)."""
    from storage.credentials import CredentialInRecordError, check_record

    tree: dict[str, Any] = {}
    for i, item in enumerate(overrides, start=1):
        key, value = _parse_override(item, i)
        alone: dict[str, Any] = {}
        _set_dotted(alone, key, value)
        storage = alone.get("storage")
        if isinstance(storage, dict) and "storage_options" in storage:
            raise ConfigError(
                f"override {i} ({key}): storage options cannot be overrides of a run, whose overrides are "
                "stored as its flow run's parameters; set them under storage.storage_options in the config file"
            )
        _set_dotted(tree, key, value)
    try:
        check_record(
            {"config_path": None if config_path is None else str(config_path), "overrides": tree},
            record="the parameters of the flow run (Prefect stores them)",
        )
    except CredentialInRecordError as err:
        raise ConfigError(str(err)) from None


def parse_storage_options(text: str, *, source: str) -> dict[str, Any]:
    """Storage options given as JSON outside a config (`source`, e.g. an environment variable), checked
    against the same allow-list; the options as fsspec takes them. The value is never shown."""
    try:
        tree = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{source}: not JSON ({err.msg} at character {err.pos})") from None
    try:
        return StorageOptions.model_validate(tree).as_fsspec()
    except ValidationError as err:
        lines = _error_lines(err, {}, prefix="storage.storage_options")
        raise ConfigError(f"{source}: invalid storage options:\n" + "\n".join(lines)) from None


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The fully resolved config of the experiment as plain JSON-able data (what run.json freezes).

    Left out: the `launch` section (where stages run: placement never changes results) and the
    storage options (where the store is; never recorded anywhere, see `StorageOptions`)."""
    return cfg.model_dump(mode="json", exclude={"launch": True, "storage": {"storage_options"}})


def stored_tree(config: dict[str, Any]) -> dict[str, Any]:
    """A config as a run stored it, ready for `build_config`: storage options, which a run created
    before they left run.json may hold, are dropped (they come from the config of the process)."""
    tree = json.loads(json.dumps(config))
    storage = tree.get("storage")
    if isinstance(storage, dict):
        storage.pop("storage_options", None)
    return tree


def full_dict(cfg: RunConfig) -> dict[str, Any]:
    """Everything, placement included (what `sdpo validate` prints)."""
    return cfg.model_dump(mode="json")


def config_hash(cfg: RunConfig) -> str:
    """sha256 of the canonical JSON of the resolved config."""
    blob = json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> leaf values (MLflow params, config diffs)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out
