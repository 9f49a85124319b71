"""A stand-in for an SGLang server: SGLang's native HTTP API, answered by the embedded engine.

SGLang's runtime cannot run on a CPU-only machine, so the SGLang rollout client is tested against
this server. Its answers are real (the embedded engine's sampler on an HF checkpoint); its request
and answer shapes follow SGLang's own source, read for the 0.5.x line (the GPU extra pins 0.5.17):

- `python/sglang/srt/entrypoints/http_server.py` (sgl-project/sglang, commit 9c0549b and later
  main): the routes `/health`, `/health_generate` (503 while starting, 200 when up),
  `/get_model_info` (`model_path`, `tokenizer_path`, `is_generation`, `weight_version`, ...),
  `/get_weight_version`, `/generate` (POST or PUT; a `ValueError` becomes HTTP 400 with body
  `{"error": {"message": ...}}`), `/update_weights_from_disk` (200 or 400 with `{"success",
  "message", "num_paused_requests"}`), `/flush_cache` (GET or POST, a plain-text answer).
- `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput` (`text` or `input_ids`, single or
  batch; `sampling_params` a dict or one per input; `return_logprob`, `logprob_start_len`,
  `top_logprobs_num`, `return_text_in_logprobs`, `rid`, `stream`; parallel sampling `n` repeats
  the whole input list) and `UpdateWeightFromDiskReqInput` (`model_path`, `load_format`,
  `abort_all_requests`, `weight_version`; a missing `weight_version` leaves the old one).
- `python/sglang/srt/sampling/sampling_params.py` (commit 00c17ca): `max_new_tokens`,
  `stop_token_ids`, `temperature` (0 means greedy), `top_p`, `top_k`, `min_p`, `n`, `ignore_eos`,
  `skip_special_tokens`, `no_stop_trim`, `sampling_seed` (the per-request seed).
- `python/sglang/srt/managers/tokenizer_manager.py` (`_handle_batch_output`, `detokenize_logprob_tokens`):
  `meta_info` holds `id`, `finish_reason`, `prompt_tokens`, `weight_version`, `completion_tokens`,
  `cached_tokens`; with `return_logprob`, `output_token_logprobs` is a list of
  `[logprob, token_id, text-or-null]`, `output_top_logprobs` one such list of K entries per token
  (only when `top_logprobs_num` > 0), and the `input_*` pair covers the prompt from
  `logprob_start_len` (null log-prob for the first prompt token).
- `python/sglang/srt/managers/schedule_batch.py` (`FINISH_MATCHED_TOKEN`, `FINISH_LENGTH`,
  `Req.check_finished`): `finish_reason` is `{"type": "stop", "matched": id}` or
  `{"type": "length", "length": max_new_tokens}`; the length limit is checked before the stop
  tokens; besides `stop_token_ids` a request stops on the model's EOS ids unless `ignore_eos`
  (which disables both). `detokenizer_manager.py`: `output_ids` keep the matched stop token,
  only the text is trimmed.
- Log-probs are the raw `log_softmax` (as SGLang with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`,
  `layers/sampler.py`), unless the `tempered_logprobs` fault makes them SGLang's default ones.

Where it differs from SGLang, on purpose: no streaming, no multimodal inputs, no `top_k` other
than -1/1 and no `min_p` (400); unknown sampling parameters are rejected (400) instead of
crashing; `input_*` log-probs are empty for `logprob_start_len = -1`. Sampling: a request with
`sampling_seed` draws its uniforms like the embedded engine draws those of sample (seed, i, j),
where `tasks.engines.sglang.schema.split_sample_seed` unpacks the seed; so the SGLang client's rows
equal the embedded engine's for the same seed. Requests that arrive together are batched.

Faults (at start-up, via `RunningServer.faults`, or `POST /_faults` with a `Fault` as JSON;
`DELETE /_faults` clears them; `GET /_stats` counts requests and lists the weight updates):
`503`/`500` answers, `drop` (sends the headers, then closes the socket mid-body), `slow` (sleeps
before answering), `unhealthy` (`/health*` answer 503), `wrong_version` (reports another weight
version), `tempered_logprobs`.

Run it alone: `python -m tests.sglang_server.app --model-path CKPT --port 30000`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

__all__ = ["Fault", "FaultKind", "FaultPlan", "RunningServer", "create_app", "start_server"]

logger = logging.getLogger(__name__)

FaultKind = Literal["500", "503", "drop", "slow", "unhealthy", "wrong_version", "tempered_logprobs"]
_DEFAULT_PATH: dict[str, str | None] = {
    "500": "/generate",
    "503": "/generate",
    "drop": "/generate",
    "slow": "/generate",
    "unhealthy": "/health",
    "wrong_version": None,
    "tempered_logprobs": "/generate",
}
_REQUEST_FAULTS = ("500", "503", "drop", "slow", "unhealthy")
_SAMPLING_KEYS = {
    "max_new_tokens",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "stop",
    "spaces_between_special_tokens",
}


# --------------------------------------------------------------------------- faults


@dataclass
class Fault:
    """Apply `kind` to the next `times` requests whose path starts with `path` (-1: until cleared)."""

    kind: FaultKind
    times: int = 1
    path: str | None = None  # None: the kind's usual target (/generate, /health, or every path)
    delay_s: float = 1.0  # slow
    version: str = "stale-weights"  # wrong_version

    def __post_init__(self) -> None:
        if self.kind not in _DEFAULT_PATH:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {sorted(_DEFAULT_PATH)}")
        if self.times == 0 or self.times < -1:
            raise ValueError(f"times must be >= 1 or -1 (until cleared), got {self.times}")
        if self.path is None:
            self.path = _DEFAULT_PATH[self.kind]


@dataclass
class FaultPlan:
    """The faults to inject, and what was received and injected (thread-safe)."""

    faults: list[Fault] = field(default_factory=list)
    received: Counter = field(default_factory=Counter)  # path -> requests
    injected: list[tuple[str, str]] = field(default_factory=list)  # (kind, path)
    weight_updates: list[tuple[str, str]] = field(default_factory=list)  # (model_path, weight_version) loaded
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, fault: Fault) -> None:
        with self.lock:
            self.faults.append(fault)

    def clear(self) -> None:
        with self.lock:
            self.faults.clear()

    def reset_stats(self) -> None:
        with self.lock:
            self.received.clear()
            self.injected.clear()
            self.weight_updates.clear()

    def take(self, kinds: tuple[str, ...], path: str) -> Fault | None:
        """The first live fault of `kinds` for `path`, counting one use of it."""
        with self.lock:
            for fault in self.faults:
                if fault.kind in kinds and (fault.path is None or path.startswith(fault.path)):
                    if fault.times > 0:
                        fault.times -= 1
                    self.faults = [f for f in self.faults if f.times != 0]
                    self.injected.append((fault.kind, path))
                    return fault
        return None


class _Dropped(Exception):
    """Raised after a partial answer: uvicorn then closes the connection."""


class _FaultMiddleware:
    """ASGI middleware injecting the request-level faults before the app sees the request."""

    def __init__(self, app: Any, plan: FaultPlan) -> None:
        self.app = app
        self.plan = plan

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/_"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        with self.plan.lock:
            self.plan.received[path] += 1
        fault = self.plan.take(_REQUEST_FAULTS, path)
        if fault is None:
            await self.app(scope, receive, send)
        elif fault.kind == "slow":
            await asyncio.sleep(fault.delay_s)
            await self.app(scope, receive, send)
        elif fault.kind == "drop":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"text": "', "more_body": True})
            raise _Dropped(f"injected dropped connection on {path}")
        else:  # 500, 503, unhealthy
            status = 503 if fault.kind == "unhealthy" else int(fault.kind)
            body = b"" if fault.kind == "unhealthy" else (b'{"error": {"message": "injected HTTP %d"}}' % status)
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------- the model side


@dataclass(frozen=True)
class _Job:
    """One sample to draw."""

    input_ids: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: frozenset[int]
    top_k: int
    seed: int | None
    tempered: bool

    @property
    def key(self) -> tuple:
        """Jobs with the same key run in one batch of the embedded engine."""
        return (self.temperature, self.top_p, self.max_new_tokens, self.stop, self.top_k, self.tempered)


@dataclass
class _Sample:
    ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finish: dict[str, Any]


class _Backend:
    """The embedded engine and tokenizer behind the API, with SGLang's server-side state."""

    def __init__(self, checkpoint_dir: str, *, weight_version: str, max_batch_size: int) -> None:
        from tasks.engines.embedded import EmbeddedEngine

        self.engine = EmbeddedEngine(checkpoint_dir, max_batch_size=max_batch_size)
        self.weight_version = weight_version
        self._read_model_side(checkpoint_dir)

    def _read_model_side(self, checkpoint_dir: str) -> None:
        from transformers import AutoTokenizer

        self.model_path = str(Path(checkpoint_dir).resolve())
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        config = self.engine.model.config
        self.context_length = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        eos: set[int] = set()
        for source in (
            config.eos_token_id,
            self.engine.model.generation_config.eos_token_id,
            self.tokenizer.eos_token_id,
        ):
            if source is not None:
                eos.update([source] if isinstance(source, int) else source)
        self.eos_ids = frozenset(int(t) for t in eos)

    def load(self, model_path: str) -> None:
        self.engine.load_weights(model_path)
        self._read_model_side(model_path)

    def sample(self, jobs: list[_Job]) -> list[_Sample]:
        """Draw `jobs` (all with one key) in one embedded-engine batch."""
        import torch

        from tasks.engines.sglang.schema import split_sample_seed

        head = jobs[0]
        uniforms = None
        if head.temperature > 0:
            rows = []
            for job in jobs:
                if job.seed is None:
                    rng = np.random.default_rng()
                elif job.seed < 2**62:
                    rng = np.random.default_rng(list(split_sample_seed(job.seed)))
                else:
                    rng = np.random.default_rng(job.seed)
                rows.append(rng.random(head.max_new_tokens))
            uniforms = np.stack(rows)  # [B, max_new_tokens]
        tempered = head.tempered and head.temperature > 0
        inner_k = self.vocab_size if tempered else head.top_k
        with torch.no_grad():
            generations = self.engine._generate_batch(
                [job.input_ids for job in jobs],
                uniforms=uniforms,
                temperature=head.temperature,
                top_p=head.top_p,
                max_new_tokens=head.max_new_tokens,
                stop_token_ids=sorted(head.stop),
                top_k=inner_k,
            )
        samples = []
        for gen in generations:
            ids = list(gen.response_ids)
            logprobs, top_ids, top_lps = gen.sampled_logprobs, gen.topk_ids, gen.topk_logprobs
            if tempered:  # SGLang's default: log_softmax(logits / T), from the full sorted distribution
                scaled = top_lps.astype(np.float64) / head.temperature  # [T, V]
                scaled -= np.logaddexp.reduce(scaled, axis=1, keepdims=True)
                logprobs = np.array([scaled[t, int(np.nonzero(top_ids[t] == tok)[0][0])] for t, tok in enumerate(ids)])
                top_ids, top_lps = top_ids[:, : head.top_k], scaled[:, : head.top_k]
            if len(ids) >= head.max_new_tokens:
                finish = {"type": "length", "length": head.max_new_tokens}
            else:
                finish = {"type": "stop", "matched": ids[-1]}
            samples.append(_Sample(ids, logprobs.tolist(), top_ids.tolist(), top_lps.tolist(), finish))
        return samples

    def prompt_logprobs(self, ids: list[int], start: int, top_k: int) -> tuple[list, list]:
        """SGLang's input_token_logprobs / input_top_logprobs for prompt positions start..end."""
        import torch

        with torch.no_grad():
            logits = self.engine.model(input_ids=torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)  # [L, V]; row p predicts token p + 1
        tokens, tops = [], []
        for p in range(start, len(ids)):
            if p == 0:
                tokens.append([None, ids[0], None])
                tops.append(None)
                continue
            row = logprobs[p - 1]
            tokens.append([_json_float(row[ids[p]].item()), ids[p], None])
            values, indices = row.topk(top_k) if top_k else (row[:0], row[:0].long())
            tops.append(
                [[_json_float(v), int(i), None] for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
            )
        return tokens, tops


class _Batcher:
    """Collects concurrent samples and runs them in engine batches, one batch at a time."""

    def __init__(self, backend: _Backend, *, max_batch_size: int, model_lock: asyncio.Lock) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.model_lock = model_lock
        self.pending: list[tuple[_Job, asyncio.Future]] = []
        self.wakeup = asyncio.Event()

    async def submit(self, jobs: list[_Job]) -> list[_Sample]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in jobs]
        self.pending.extend(zip(jobs, futures, strict=True))
        self.wakeup.set()
        return list(await asyncio.gather(*futures))

    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            # let requests arriving together share a batch: wait until 2 ms pass without a new one
            waited, seen = 0.0, -1
            while len(self.pending) != seen and len(self.pending) < self.max_batch_size and waited < 0.02:
                seen = len(self.pending)
                await asyncio.sleep(0.002)
                waited += 0.002
            taken, self.pending = self.pending[: self.max_batch_size], self.pending[self.max_batch_size :]
            if not self.pending:
                self.wakeup.clear()
            groups: dict[tuple, list[tuple[_Job, asyncio.Future]]] = {}
            for job, future in taken:
                groups.setdefault(job.key, []).append((job, future))
            for group in groups.values():
                async with self.model_lock:
                    try:
                        samples = await asyncio.to_thread(self.backend.sample, [job for job, _ in group])
                    except Exception as exc:  # hand the failure to the waiting requests (HTTP 500)
                        for _, future in group:
                            if not future.done():
                                future.set_exception(exc)
                        continue
                for (_, future), sample in zip(group, samples, strict=True):
                    if not future.done():
                        future.set_result(sample)


# --------------------------------------------------------------------------- the app


def create_app(
    checkpoint_dir: str,
    *,
    weight_version: str = "default",
    max_batch_size: int = 64,
    faults: FaultPlan | None = None,
) -> Any:
    """The FastAPI app serving `checkpoint_dir`, wrapped in the fault-injection middleware."""
    plan = faults if faults is not None else FaultPlan()
    backend = _Backend(checkpoint_dir, weight_version=weight_version, max_batch_size=max_batch_size)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: Any) -> Any:
        state["lock"] = asyncio.Lock()
        state["batcher"] = _Batcher(backend, max_batch_size=max_batch_size, model_lock=state["lock"])
        task = asyncio.create_task(state["batcher"].run())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    def reported_version(path: str) -> str:
        fault = plan.take(("wrong_version",), path)
        return backend.weight_version if fault is None else fault.version

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        job = _Job([0], 0.0, 1.0, 1, frozenset(), 0, None, False)  # SGLang probes with input_ids [0] too
        await state["batcher"].submit([job])
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info(request: Request) -> dict:
        return {
            "model_path": backend.model_path,
            "tokenizer_path": backend.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": reported_version(request.url.path),
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def get_weight_version(request: Request) -> dict:
        return {"weight_version": reported_version(request.url.path)}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await request.json()
        model_path = body.get("model_path") if isinstance(body, dict) else None
        if not model_path or not (Path(model_path) / "config.json").is_file():
            return JSONResponse(
                {
                    "success": False,
                    "message": f"cannot load weights: {model_path!r} has no config.json",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        async with state["lock"]:
            await asyncio.to_thread(backend.load, model_path)
            if body.get("weight_version") is not None:
                backend.weight_version = str(body["weight_version"])
            with plan.lock:
                plan.weight_updates.append((backend.model_path, backend.weight_version))
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        started = time.perf_counter()
        tempered = plan.take(("tempered_logprobs",), request.url.path) is not None
        try:
            body = await request.json()
            items, single = _parse_generate(body, backend, tempered=tempered)
        except ValueError as exc:
            return error(400, str(exc))
        runnable = [item for item in items if item["job"].max_new_tokens > 0]
        samples = dict(
            zip(
                (id(item) for item in runnable),
                await state["batcher"].submit([item["job"] for item in runnable]),
                strict=True,
            )
        )
        version = reported_version(request.url.path)
        outputs = []
        for item in items:
            sample = samples.get(id(item)) or _Sample([], [], [], [], {"type": "length", "length": 0})
            prompt_tokens = prompt_tops = None
            if item["return_logprob"] and item["logprob_start_len"] >= 0:
                async with state["lock"]:
                    prompt_tokens, prompt_tops = await asyncio.to_thread(
                        backend.prompt_logprobs,
                        item["job"].input_ids,
                        item["logprob_start_len"],
                        item["top_logprobs_num"],
                    )
            outputs.append(
                _render(
                    item,
                    sample,
                    backend,
                    version=version,
                    started=started,
                    prompt_tokens=prompt_tokens or [],
                    prompt_tops=prompt_tops or [],
                )
            )
        return JSONResponse(outputs[0] if single else outputs)

    @app.post("/_faults")
    async def add_fault(request: Request) -> dict:
        fault = Fault(**(await request.json()))
        plan.add(fault)
        return asdict(fault)

    @app.delete("/_faults")
    async def clear_faults() -> dict:
        plan.clear()
        return {"cleared": True}

    @app.get("/_stats")
    async def stats() -> dict:
        with plan.lock:
            return {
                "received": dict(plan.received),
                "injected": [list(x) for x in plan.injected],
                "weight_updates": [list(x) for x in plan.weight_updates],
            }

    return _FaultMiddleware(app, plan)


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    """A scalar broadcast to every input, or a list with one value per input (GenerateReqInput)."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} inputs")
        return value
    return [value] * count


def _parse_generate(body: Any, backend: _Backend, *, tempered: bool) -> tuple[list[dict], bool]:
    """Validate a /generate body and expand it into one item per sample to draw."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if body.get("stream"):
        raise ValueError("stream=True is not supported by this test server")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text or input_ids")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        inputs = [backend.tokenizer.encode(t) for t in texts]
    else:
        if not isinstance(input_ids, list) or len(input_ids) == 0:
            raise ValueError("input_ids must be a non-empty list")
        single = isinstance(input_ids[0], int)
        inputs = [input_ids] if single else list(input_ids)
    count = len(inputs)
    params = _per_item(body.get("sampling_params") or {}, count, "sampling_params")
    return_logprob = _per_item(body.get("return_logprob") or False, count, "return_logprob")
    top_n = _per_item(body.get("top_logprobs_num") or 0, count, "top_logprobs_num")
    start = _per_item(
        -1 if body.get("logprob_start_len") is None else body["logprob_start_len"], count, "logprob_start_len"
    )
    rids = _per_item(body.get("rid"), count, "rid")
    n_values = {int(p.get("n", 1) or 1) for p in params}
    if len(n_values) != 1:
        raise ValueError(f"every sampling_params entry must have the same n, got {sorted(n_values)}")
    n = n_values.pop()
    if n > 1:  # parallel sampling repeats the whole input list n times
        single = False
        inputs, params, return_logprob, top_n, start, rids = (
            x * n for x in (inputs, params, return_logprob, top_n, start, rids)
        )
    items = []
    for index, (ids, p, want_lp, k, s, rid) in enumerate(
        zip(inputs, params, return_logprob, top_n, start, rids, strict=True)
    ):
        if not isinstance(p, dict):
            raise ValueError(f"sampling_params[{index}] must be an object")
        unknown = set(p) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
        if p.get("stop"):
            raise ValueError("stop strings are not supported by this test server")
        if len(ids) == 0 or not all(isinstance(t, int) and 0 <= t < backend.vocab_size for t in ids):
            raise ValueError(f"input {index}: token ids must be non-empty and in [0, {backend.vocab_size})")
        temperature = float(1.0 if p.get("temperature") is None else p["temperature"])
        top_p = float(1.0 if p.get("top_p") is None else p["top_p"])
        max_new_tokens = int(128 if p.get("max_new_tokens") is None else p["max_new_tokens"])
        top_k = int(-1 if p.get("top_k") is None else p["top_k"])
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if top_k not in (-1, 1) or float(p.get("min_p") or 0.0) != 0.0:
            raise ValueError("this test server supports only top_k in {-1, 1} and min_p = 0")
        if top_k == 1:
            temperature = 0.0
        if not 0 <= int(k) <= backend.vocab_size:
            raise ValueError(f"top_logprobs_num={k} must be in [0, {backend.vocab_size}]")
        if len(ids) + max_new_tokens > backend.context_length:
            raise ValueError(
                f"input {index} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} tokens, more than the context length of {backend.context_length}"
            )
        if not -1 <= int(s) < len(ids):
            raise ValueError(f"logprob_start_len={s} must be in [-1, {len(ids)})")
        stop = frozenset(int(t) for t in p.get("stop_token_ids") or ()) | backend.eos_ids
        if p.get("ignore_eos"):  # SGLang's ignore_eos turns off stop_token_ids too
            stop = frozenset()
        seed = p.get("sampling_seed")
        job = _Job(
            list(ids), temperature, top_p, max_new_tokens, stop, int(k), None if seed is None else int(seed), tempered
        )
        items.append(
            {
                "job": job,
                "rid": rid or uuid.uuid4().hex,
                "return_logprob": bool(want_lp),
                "top_logprobs_num": int(k),
                "logprob_start_len": int(s),
                "skip_special_tokens": p.get("skip_special_tokens", True) is not False,
                "no_stop_trim": bool(p.get("no_stop_trim")),
            }
        )
    return items, single


def _json_float(value: float) -> float | None:
    """JSON has no infinities; SGLang's encoder writes them as null."""
    return value if math.isfinite(value) else None


def _render(
    item: dict,
    sample: _Sample,
    backend: _Backend,
    *,
    version: str,
    started: float,
    prompt_tokens: list,
    prompt_tops: list,
) -> dict:
    """One sample as SGLang's /generate answer."""
    job: _Job = item["job"]
    text_ids = sample.ids
    if sample.finish["type"] == "stop" and not item["no_stop_trim"]:
        text_ids = sample.ids[:-1]
    meta: dict[str, Any] = {
        "id": item["rid"],
        "finish_reason": sample.finish,
        "prompt_tokens": len(job.input_ids),
        "weight_version": version,
        "completion_tokens": len(sample.ids),
        "cached_tokens": 0,
        "e2e_latency": time.perf_counter() - started,
    }
    if item["return_logprob"]:
        meta["input_token_logprobs"] = prompt_tokens
        meta["output_token_logprobs"] = [
            [_json_float(lp), tok, None] for lp, tok in zip(sample.logprobs, sample.ids, strict=True)
        ]
        if item["top_logprobs_num"] > 0:
            meta["input_top_logprobs"] = prompt_tops
            meta["output_top_logprobs"] = [
                [[_json_float(lp), int(t), None] for lp, t in zip(lps, ids, strict=True)]
                for lps, ids in zip(sample.top_logprobs, sample.top_ids, strict=True)
            ]
    return {
        "text": backend.tokenizer.decode(text_ids, skip_special_tokens=item["skip_special_tokens"]),
        "output_ids": list(sample.ids),
        "meta_info": meta,
    }


# --------------------------------------------------------------------------- running it


@dataclass
class RunningServer:
    """A test server on 127.0.0.1 in a background thread; `stop()` shuts it down."""

    url: str
    faults: FaultPlan
    server: Any
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            raise RuntimeError(f"the test server at {self.url} did not stop within 10 s")

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    checkpoint_dir: str | Path,
    *,
    weight_version: str = "default",
    max_batch_size: int = 64,
    faults: list[Fault] | None = None,
    host: str = "127.0.0.1",
    log_level: str = "warning",
) -> RunningServer:
    """Serve `checkpoint_dir` at a free port in a daemon thread; returns once it accepts requests."""
    import uvicorn

    plan = FaultPlan()
    for fault in faults or []:
        plan.add(fault)
    app = create_app(str(checkpoint_dir), weight_version=weight_version, max_batch_size=max_batch_size, faults=plan)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=2)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"sglang-test-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the test server on port {port} did not start")
        time.sleep(0.01)
    return RunningServer(url=f"http://{host}:{port}", faults=plan, server=server, thread=thread)


def iter_faults(specs: list[str]) -> Iterator[Fault]:
    """Faults from `kind[:times]` strings, for the command line."""
    for spec in specs:
        kind, _, times = spec.partition(":")
        yield Fault(kind=kind, times=int(times or 1))  # type: ignore[arg-type]


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve a checkpoint through SGLang's native HTTP API (test server).")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--fault", action="append", default=[], help="kind[:times], e.g. 503:2")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    plan = FaultPlan()
    for fault in iter_faults(args.fault):
        plan.add(fault)
    app = create_app(
        args.model_path, weight_version=args.weight_version, max_batch_size=args.max_batch_size, faults=plan
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
