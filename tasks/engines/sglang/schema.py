"""SGLang's native `/generate` API as the client speaks it: request bodies, answers, seeds.

A prompt's `n` samples go out as one batch request (one `sampling_params` entry per sample, each
with its own `sampling_seed`), or, through an sglang-router, as one request per sample (the
router's `/generate` takes a single `sampling_params` object). The answers become the
`Generation` rows the embedded engine returns:

- **Token ids** come from `meta_info.output_token_logprobs` (one `[logprob, id, text]` entry per
  generated token, stop token included). `output_ids` must agree with them, with or without the
  matched stop token at the end (releases differ in whether they trim it).
- **Finish reason.** SGLang checks the length limit before the stop tokens, so a stop token drawn
  as the last allowed token comes back as `{"type": "length"}`; the client reports "stop" then, as
  the embedded engine does. SGLang also stops on the model's own EOS ids (generation config,
  tokenizer) even when the caller did not list them; such a stop is reported as "stop" with a
  warning, since the token is in the response either way. `{"type": "abort"}` is retried.
- **Log-probs** are JSON numbers, with `null` for -inf (JSON has no infinities).
- **Seeds.** Sample j of prompt i gets `sampling_seed = sample_seed(seed, i, j)`, a packed 62-bit
  integer, so a rollout is reproducible for a seed on the same servers and weights (SGLang needs
  `--sampling-backend pytorch` for seeded top-p sampling). The tokens differ from the embedded
  engine's: the two engines draw their random numbers differently.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from tasks.engines.base import FinishReason, Generation, SamplingParams
from tasks.engines.sglang.errors import SGLangProtocolError, SGLangWeightVersionError, TransientFailure

__all__ = [
    "answer_outputs",
    "generate_bodies",
    "logprob",
    "parse_generation",
    "sample_seed",
    "split_sample_seed",
]

logger = logging.getLogger(__name__)

# sample_seed layout, low bits first: sample index (12 bits), prompt index (20), run seed (30).
_SAMPLE_BITS, _PROMPT_BITS, _SEED_BITS = 12, 20, 30


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The per-request `sampling_seed` of sample `sample_index` of prompt `prompt_index`.

    Packs (seed mod 2**30, prompt_index, sample_index) into 62 bits, so it fits SGLang's int64
    seeds and `split_sample_seed` recovers the parts.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not 0 <= prompt_index < 2**_PROMPT_BITS:
        raise ValueError(f"prompt_index={prompt_index} must be in [0, {2**_PROMPT_BITS}) per generate call")
    if not 0 <= sample_index < 2**_SAMPLE_BITS:
        raise ValueError(f"sample_index={sample_index} must be in [0, {2**_SAMPLE_BITS}) (samples per prompt)")
    low_seed = seed % 2**_SEED_BITS
    return (low_seed << (_PROMPT_BITS + _SAMPLE_BITS)) | (prompt_index << _SAMPLE_BITS) | sample_index


def split_sample_seed(value: int) -> tuple[int, int, int]:
    """Inverse of `sample_seed`: (seed mod 2**30, prompt_index, sample_index)."""
    if not 0 <= value < 2 ** (_SEED_BITS + _PROMPT_BITS + _SAMPLE_BITS):
        raise ValueError(f"{value} is not a packed sample seed")
    sample_index = value & (2**_SAMPLE_BITS - 1)
    prompt_index = (value >> _SAMPLE_BITS) & (2**_PROMPT_BITS - 1)
    return value >> (_PROMPT_BITS + _SAMPLE_BITS), prompt_index, sample_index


def generate_bodies(
    prompt_index: int, prompt: list[int], params: SamplingParams, *, per_sample: bool
) -> list[dict[str, Any]]:
    """The `/generate` bodies for prompt `prompt_index`'s `params.n` samples.

    One batch body (a list of `sampling_params`), or with `per_sample` (the router) one body per
    sample carrying the same `sampling_seed` it would have in the batch.
    """
    sampling = []
    for j in range(params.n):
        p: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": params.stop_token_ids,
        }
        if params.temperature > 0:  # greedy needs no seed (and flashinfer rejects seeds with top_k=1)
            p["sampling_seed"] = sample_seed(params.seed, prompt_index, j)
        sampling.append(p)
    common = {
        "return_logprob": True,
        "top_logprobs_num": params.top_k_logprobs,
        "logprob_start_len": -1,
        "return_text_in_logprobs": False,
        "stream": False,
    }
    if per_sample:
        return [{"input_ids": prompt, "sampling_params": p, **common} for p in sampling]
    return [{"input_ids": [prompt] * params.n, "sampling_params": sampling, **common}]


def answer_outputs(answer: Any, body: dict[str, Any], *, url: str) -> list[Any]:
    """The per-sample outputs of the answer to `body`: one for a single request, one per batch entry."""
    batch = len(body["sampling_params"]) if isinstance(body["sampling_params"], list) else None
    if batch is None:
        if not isinstance(answer, dict):
            raise SGLangProtocolError(f"{url}/generate answered a single request with {type(answer).__name__}")
        return [answer]
    if not isinstance(answer, list) or len(answer) != batch:
        raise SGLangProtocolError(
            f"{url}/generate answered a batch of {batch} with "
            f"{len(answer) if isinstance(answer, list) else type(answer).__name__}"
        )
    return answer


def parse_generation(
    out: dict[str, Any],
    *,
    url: str,
    expected_version: str,
    stop_token_ids: list[int],
    top_k: int,
    warned_eos: set[int],
) -> Generation:
    """One `/generate` answer -> Generation, in the embedded engine's conventions.

    `warned_eos` holds the unrequested EOS ids already warned about; a new one is warned about
    once and added.
    """
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangProtocolError(f"{url}/generate answer has no meta_info: {str(out)[:300]}")
    reported = meta.get("weight_version")
    if reported is not None and reported != expected_version:
        raise SGLangWeightVersionError(f"{url} answered with weights {reported!r}, expected {expected_version!r}")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or "type" not in finish:
        raise SGLangProtocolError(f"{url}/generate answer has no finish_reason: {meta}")
    if finish["type"] == "abort":
        raise TransientFailure(f"{url} aborted the request: {finish.get('message', finish)}")
    token_logprobs = meta.get("output_token_logprobs")
    if not isinstance(token_logprobs, list) or not token_logprobs:
        raise SGLangProtocolError(f"{url}/generate answer has no output_token_logprobs: {str(meta)[:300]}")
    response_ids = [int(entry[1]) for entry in token_logprobs]
    num_tokens = len(response_ids)
    output_ids = out.get("output_ids")
    if output_ids is not None and output_ids not in (response_ids, response_ids[:-1]):
        raise SGLangProtocolError(
            f"{url}: output_ids {output_ids} disagree with output_token_logprobs ids {response_ids}"
        )
    sampled = np.array([logprob(entry[0]) for entry in token_logprobs], dtype=np.float32)  # [T]

    if top_k > 0:
        top = meta.get("output_top_logprobs")
        if not isinstance(top, list) or len(top) != num_tokens:
            raise SGLangProtocolError(
                f"{url}: output_top_logprobs has {len(top) if isinstance(top, list) else top!r} rows, "
                f"expected {num_tokens}"
            )
        if any(not isinstance(row, list) or len(row) != top_k for row in top):
            raise SGLangProtocolError(f"{url}: output_top_logprobs rows must hold {top_k} entries each")
        topk_ids = np.array([[int(e[1]) for e in row] for row in top], dtype=np.int32)  # [T, K]
        topk_logprobs = np.array([[logprob(e[0]) for e in row] for row in top], dtype=np.float32)  # [T, K]
    else:
        topk_ids = np.zeros((num_tokens, 0), dtype=np.int32)
        topk_logprobs = np.zeros((num_tokens, 0), dtype=np.float32)

    return Generation(
        response_ids=response_ids,
        sampled_logprobs=sampled,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        finish_reason=_finish_reason(finish, response_ids, stop_token_ids, url=url, warned_eos=warned_eos),
    )


def _finish_reason(
    finish: dict[str, Any], response_ids: list[int], stop_token_ids: list[int], *, url: str, warned_eos: set[int]
) -> FinishReason:
    last = response_ids[-1]
    if finish["type"] == "length":
        return "stop" if last in stop_token_ids else "length"
    if finish["type"] != "stop":
        raise SGLangProtocolError(f"{url}: unknown finish_reason {finish}")
    matched = finish.get("matched")
    if not isinstance(matched, int) or matched != last:
        raise SGLangProtocolError(
            f"{url}: finish_reason {finish} does not name the last token {last} (stop strings are never sent)"
        )
    if matched not in stop_token_ids and matched not in warned_eos:
        warned_eos.add(matched)
        logger.warning(
            "%s stopped on token %d, not in stop_token_ids %s (the model's own EOS); reported as 'stop'",
            url,
            matched,
            stop_token_ids,
        )
    return "stop"


def logprob(value: Any) -> float:
    """A log-prob of an answer: SGLang serialises -inf as null (JSON has no infinities)."""
    return float("-inf") if value is None else float(value)
