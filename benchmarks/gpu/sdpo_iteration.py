"""One full SDPO iteration on one GPU with stage times: rollout, teacher scoring, training.

A random-init Qwen3 model of `--shape` (default the 0.6B shape) is saved as an HF folder and used
by all three stages, as in the pipeline:
- rollout: `tasks.engines.embedded.EmbeddedEngine` on the GPU (bf16, KV cache), G answers per
  prompt with the student's top-K log-probs;
- teacher: each answer is scored under a teacher prompt that shows a peer's answer before the
  question (the SDPO reprompt shape), with the Megatron scorer (`teacher.backend=megatron`) and,
  for comparison, the embedded HF scorer;
- train: `MegatronTrainer.train_iteration` with the GPU path (SDPA, packing, chunked compiled
  loss, fused kernels); the first iteration includes compilation, so a second one is timed too.

    python benchmarks/gpu/sdpo_iteration.py [--prompts 16 --group 4 --new-tokens 256]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.common import DEVICE, emit, environment, gib, peak, qwen3_config, timed


def free() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--probe", action="store_true", help="also train one step per GPU-path variant, fresh each")
    args = parser.parse_args()
    emit({"bench": "environment", **environment()})

    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from sdpo_core.grpo import group_advantages
    from tasks.config import build_config
    from tasks.engines.embedded import EmbeddedEngine
    from tasks.engines.scorer import score_teacher
    from tasks.megatron.scorer import MegatronTeacherScorer
    from tasks.megatron.trainer import MegatronTrainer

    hf_config = qwen3_config(args.shape)
    vocab = hf_config.vocab_size
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "policy"
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model, setup_s = timed(lambda: Qwen3ForCausalLM(hf_config).to(torch.bfloat16))
        model.save_pretrained(hf_dir)
        del model
        prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(args.prompts)]

        engine = EmbeddedEngine(
            str(hf_dir), device=DEVICE, dtype=torch.bfloat16, max_batch_size=args.prompts * args.group
        )
        gens, rollout_s = timed(
            lambda: engine.generate(
                prompts,
                n=args.group,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                stop_token_ids=[],
                top_k_logprobs=args.k,
                seed=0,
            )
        )
        engine.close()
        del engine
        free()
        samples = [(i, j, g) for i, group in enumerate(gens) for j, g in enumerate(group)]
        response_tokens = sum(len(g.response_ids) for _, _, g in samples)

        # SDPO reprompt shape: a peer's answer as the demonstration, then the question again.
        teacher_prompts = [prompts[i] + gens[i][(j + 1) % args.group].response_ids + prompts[i] for i, j, _ in samples]
        sequences = [(tp, g.response_ids) for tp, (_, _, g) in zip(teacher_prompts, samples, strict=True)]
        topk = [g.topk_ids.astype(np.int64) for _, _, g in samples]
        teacher_tokens = sum(len(p) + len(r) for p, r in sequences)

        fused = DEVICE == "cuda"
        scorer, load_s = timed(lambda: MegatronTeacherScorer.from_hf(hf_dir, dtype=torch.bfloat16, fused_kernels=fused))
        scorer.score(sequences=sequences, topk_ids=topk, batch_tokens=16384)  # warm-up (kernel compilation)
        mega, teacher_s = timed(lambda: scorer.score(sequences=sequences, topk_ids=topk, batch_tokens=16384))
        del scorer
        free()
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(DEVICE).eval()
        score_teacher(hf_model, sequences=sequences[:4], topk_ids=topk[:4], batch_tokens=16384)  # warm-up
        emb, embedded_s = timed(lambda: score_teacher(hf_model, sequences=sequences, topk_ids=topk, batch_tokens=16384))
        del hf_model
        free()
        agree = float(
            np.mean([np.abs(a.topk_logprobs - b.topk_logprobs).mean() for a, b in zip(mega, emb, strict=True)])
        )

        rewards = torch.from_numpy(rng.random(len(samples)).astype(np.float32))
        groups = torch.tensor([i for i, _, _ in samples])
        columns = {
            "sample_id": list(range(len(samples))),
            "prompt_ids": [prompts[i] for i, _, _ in samples],
            "response_ids": [g.response_ids for _, _, g in samples],
            "topk_ids": [g.topk_ids for _, _, g in samples],
            "sampled_logprobs": [g.sampled_logprobs for _, _, g in samples],
            "teacher_topk_logprobs": [s.topk_logprobs for s in mega],
            "teacher_sampled_logprobs": [s.sampled_logprobs for s in mega],
            "advantage": group_advantages(rewards, groups, normalize_std=False).tolist(),
            "sample_mask": [True] * len(samples),
            "route": [None] * len(samples),
            "pass_rate": [0.5] * len(samples),
            "teacher_entropy": [s.entropy for s in mega],
        }

        def make_cfg(**train):
            return build_config(
                {
                    "iterations": 10,
                    "model": {
                        "dtype": "bfloat16" if DEVICE == "cuda" else "float32"
                    },  # Megatron's bf16 optimizer is CUDA-only
                    "data": {"prompts_per_iteration": args.prompts},
                    "rollout": {"group_size": args.group, "top_k": args.k},
                    "train": {
                        "steps_per_iteration": 1,
                        "attention": "sdpa",
                        "packing": True,
                        "pack_tokens": 16384,
                        "loss_chunk_tokens": 1024,
                        "loss_compile": fused,
                        "fused_kernels": fused,
                        **train,
                    },
                    "optimizer": {"lr": 1e-6},
                }
            )

        cfg = make_cfg()
        trainer, trainer_load_s = timed(lambda: MegatronTrainer(cfg, hf_dir))
        m1, train1_s = timed(lambda: trainer.train_iteration(columns, iteration=1))
        m2, train2_s = timed(lambda: trainer.train_iteration(columns, iteration=2))
        train_tokens = sum(len(p) + len(r) for p, r in zip(columns["prompt_ids"], columns["response_ids"], strict=True))
        emit(
            {
                "bench": "sdpo_iteration",
                "shape": args.shape,
                "samples": len(samples),
                "k": args.k,
                "response_tokens": response_tokens,
                "teacher_tokens": teacher_tokens,
                "train_tokens": train_tokens,
                "rollout_s": round(rollout_s, 3),
                "rollout_tokens_per_s": round(response_tokens / rollout_s),
                "teacher_megatron_s": round(teacher_s, 3),
                "teacher_megatron_tokens_per_s": round(teacher_tokens / teacher_s),
                "teacher_embedded_s": round(embedded_s, 3),
                "teacher_embedded_tokens_per_s": round(teacher_tokens / embedded_s),
                "teacher_backends_mean_abs_diff": round(agree, 4),
                "train_first_s": round(train1_s, 3),
                "train_second_s": round(train2_s, 3),
                "train_tokens_per_s_second": round(train_tokens / train2_s),
                "iteration_s_steady": round(rollout_s + teacher_s + train2_s, 3),
                "load_s": {
                    "megatron_scorer": round(load_s, 2),
                    "trainer": round(trainer_load_s, 2),
                    "init": round(setup_s, 2),
                },
                "losses": [m1["train/loss"], m2["train/loss"]],
                "peak_gib": round(gib(peak()), 1),
                "grad_norms": [m1["train/grad_norm"], m2["train/grad_norm"]],
            }
        )
        del trainer
        free()
        if args.probe:
            # Which GPU-path piece changes the step: each variant trains one step from the same weights.
            variants = {
                "as_above": {},
                "no_fused_kernels": {"fused_kernels": False},
                "no_compile": {"loss_compile": False},
                "unchunked_loss": {"loss_chunk_tokens": 0, "loss_compile": False},
                "padded_mb16": {"packing": False},
            }
            for name, train in variants.items():
                probe = MegatronTrainer(make_cfg(micro_batch_size=16, **train), hf_dir)
                metrics, seconds = timed(lambda: probe.train_iteration(columns, iteration=1))
                emit(
                    {
                        "bench": "sdpo_iteration_probe",
                        "variant": name,
                        "train_s": round(seconds, 3),
                        "loss": metrics["train/loss"],
                        "grad_norm": metrics["train/grad_norm"],
                        "is_weight_mean": metrics.get("sdpo/is_weight_mean"),
                    }
                )
                del probe
                free()


if __name__ == "__main__":
    main()
