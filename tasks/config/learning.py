"""The sections that define how the experiment learns from its samples: the teacher, the loss, the
optimizer, training, evaluation, how iterations follow each other, and test-time runs. Every value
here can change the result (run.json freezes them); what is sampled is in `tasks.config.experiment`."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_type_hints

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from tasks.config.experiment import strict_model, validation_errors
from tasks.config.section import Section


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
            strict_model(f"{policy.__name__}_kwargs", fields).model_validate(kwargs)
            policy(**kwargs)
        except ValidationError as err:
            raise ValueError(validation_errors(err)) from None
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
