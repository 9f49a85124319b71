"""Rollout engine backed by SGLang servers, spoken to over SGLang's native HTTP API.

The client sends one `/generate` request per prompt carrying that prompt's `n` samples as a batch
(one `sampling_params` entry per sample, each with its own `sampling_seed`) to the servers in
turn, or one request per sample to an sglang-router URL (the router's `/generate` takes a single
`sampling_params` object), and turns the answers into the `Generation` rows the embedded engine
returns. What it relies on, and how it maps SGLang's answer to this project's conventions:

- **Token ids** come from `meta_info.output_token_logprobs` (one `[logprob, id, text]` entry per
  generated token, stop token included). `output_ids` must agree with them, with or without the
  matched stop token at the end (releases differ in whether they trim it).
- **Finish reason.** SGLang checks the length limit before the stop tokens, so a stop token drawn
  as the last allowed token comes back as `{"type": "length"}`; the client reports "stop" then, as
  the embedded engine does. SGLang also stops on the model's own EOS ids (generation config,
  tokenizer) even when the caller did not list them; such a stop is reported as "stop" with a
  warning, since the token is in the response either way.
- **Log-probs.** For sampled (temperature > 0) requests SGLang returns log-probs of the processed
  distribution (after temperature) unless the server runs with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`;
  greedy requests always get the raw `log_softmax`. There is no per-request switch, so the launch
  script sets the variable, and the client checks it once per server: it asks for the first
  token's top-K at temperature 1 and at temperature 2 (top-p 0.5) and fails if they differ.
- **Seeds.** Sample j of prompt i gets `sampling_seed = sample_seed(seed, i, j)`, a packed 62-bit
  integer, so a rollout is reproducible for a seed on the same servers and weights (SGLang needs
  `--sampling-backend pytorch` for seeded top-p sampling). The tokens differ from the embedded
  engine's: the two engines draw their random numbers differently.
- **Weights.** `load_weights` posts `/update_weights_from_disk` with the checkpoint's local path
  (which every server must be able to read) and a `weight_version` derived from the checkpoint, then
  checks each server's `/get_model_info` and flushes the cache. Before each `generate` every server
  is asked its version again, and every answer's `meta_info.weight_version` is compared too: a
  server on other weights is an error, never used.

The Protocol is synchronous; the client runs its coroutines on a private event loop in a
background thread, so it works from plain threads and from code that already runs an event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np

from tasks.config import SGLangConfig
from tasks.engines.base import FinishReason, Generation

__all__ = [
    "SGLangEngine",
    "SGLangError",
    "SGLangLogprobError",
    "SGLangProtocolError",
    "SGLangRequestError",
    "SGLangUnavailableError",
    "SGLangWeightVersionError",
    "checkpoint_weight_version",
    "sample_seed",
    "split_sample_seed",
]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

# sample_seed layout, low bits first: sample index (12 bits), prompt index (20), run seed (30).
_SAMPLE_BITS, _PROMPT_BITS, _SEED_BITS = 12, 20, 30
_HEALTH_POLL_S = 0.25
_PROBE_TOP_K = 8
_PROBE_TOLERANCE = 0.05  # log-prob units; tempering at T=2 moves real distributions far more
_DIGEST_DIR = re.compile(r"[0-9a-f]{64}")


class SGLangError(RuntimeError):
    """Base class of the SGLang client's errors."""


class SGLangUnavailableError(SGLangError):
    """A server did not become healthy in time, or a request kept failing after all retries."""


class SGLangRequestError(SGLangError):
    """A server rejected a request (4xx, or a failed weight update); carries its message."""

    def __init__(self, *, method: str, url: str, status: int, message: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {message}")
        self.status = status
        self.url = url
        self.server_message = message


class SGLangWeightVersionError(SGLangError):
    """A server reports weights other than the ones this engine loaded."""


class SGLangProtocolError(SGLangError):
    """An answer does not have the shape of SGLang's native API."""


class SGLangLogprobError(SGLangError):
    """A server returns log-probs of the processed (tempered) distribution instead of the raw one."""


class _Transient(Exception):
    """A failure worth retrying: a connection error, a timeout, a 5xx answer, an aborted request."""


# --------------------------------------------------------------------------- seeds and versions


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


def checkpoint_weight_version(checkpoint_dir: str | Path) -> str:
    """The `weight_version` string of an HF checkpoint folder.

    Object-store checkpoints are cached in a folder named by their manifest's sha256, which
    identifies the weights; any other folder is identified by its path and its files' names,
    sizes and modification times (no need to hash gigabytes of weights).
    """
    path = Path(checkpoint_dir).resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(checkpoint_dir)!r} is not an HF checkpoint folder (no config.json)")
    if _DIGEST_DIR.fullmatch(path.name):
        return f"ckpt-{path.name[:16]}"
    digest = hashlib.sha256(str(path).encode())
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"\0{file.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return f"ckpt-{digest.hexdigest()[:16]}"


# --------------------------------------------------------------------------- the engine


class SGLangEngine:
    """A `RolloutEngine` sampling from SGLang servers (`config.urls`, optionally behind a router).

    `config.urls` lists the worker servers: health, weight updates and version checks go to each
    of them. Generation goes to them in turn, or to `router_url` when one is given. Construction
    waits until every server is healthy and makes sure they hold `checkpoint_dir`'s weights.
    """

    def __init__(
        self,
        config: SGLangConfig,
        checkpoint_dir: str,
        *,
        router_url: str | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        weight_update_timeout_s: float = 600.0,
        check_logprobs: bool = True,
    ) -> None:
        if not config.urls:
            raise ValueError("SGLangConfig.urls is empty; list the SGLang server URLs")
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s=}, {max_backoff_s=}")
        self._urls = [_normalize_url(u) for u in config.urls]
        if len(set(self._urls)) != len(self._urls):
            raise ValueError(f"SGLangConfig.urls has duplicates: {config.urls}")
        self._router_url = None if router_url is None else _normalize_url(router_url)
        self._data_urls = [self._router_url] if self._router_url is not None else list(self._urls)
        self._config = config
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._weight_update_timeout_s = weight_update_timeout_s
        self._check_logprobs = check_logprobs
        self._probed: set[str] = set()
        self._warned_eos: set[int] = set()
        self._next = 0
        self._weight_version = ""
        self._closed = False
        self._client: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(config.max_concurrency)  # binds to the private loop on first use

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._run(self._make_client())
            self._run(self._wait_healthy(self._urls, router=self._router_url))
            self._run(self._sync_weights(checkpoint_dir, force=False))
        except BaseException:
            self.close()
            raise

    # -- Protocol ------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    def load_weights(self, checkpoint_dir: str) -> None:
        """Load an HF checkpoint into every server (waiting for restarted servers to be healthy)."""
        self._run(self._wait_healthy(self._urls))
        self._run(self._sync_weights(checkpoint_dir, force=True))

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        top_k_logprobs: int,
        seed: int,
        progress: bool = False,
    ) -> list[list[Generation]]:
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {n=}, {max_new_tokens=}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature=}, {top_p=}")
        if top_k_logprobs < 0:
            raise ValueError(f"top_k_logprobs must be >= 0, got {top_k_logprobs}")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
        return self._run(
            self._generate(
                prompts,
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                stop_token_ids=[int(t) for t in stop_token_ids],
                top_k=top_k_logprobs,
                seed=seed,
                progress=progress,
            )
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sync facade ---------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, _R]) -> _R:
        """Run `coro` on the private loop and wait for it, from any thread but the loop's own."""
        if self._closed:
            coro.close()
            raise RuntimeError("the engine is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SGLangEngine methods cannot be called from the engine's own event loop")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:  # e.g. KeyboardInterrupt while waiting: stop the requests in flight too
            future.cancel()
            raise

    async def _make_client(self) -> httpx.AsyncClient:
        cfg = self._config
        return httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=min(10.0, cfg.request_timeout_s)),
            limits=httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency),
        )

    # -- HTTP with retries ---------------------------------------------------------------------

    async def _attempt(
        self, method: str, url: str, *, json: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        """One try; 4xx raises SGLangRequestError at once, anything retryable raises _Transient."""
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            response = await self._client.request(method, url, json=json, **kwargs)
        except httpx.TransportError as exc:  # connection refused/reset, dropped mid-answer, timeouts
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise _Transient(f"HTTP {response.status_code}: {_server_message(response)}")
        if response.status_code >= 400:
            raise SGLangRequestError(
                method=method, url=url, status=response.status_code, message=_server_message(response)
            )
        return response

    async def _with_retries(self, what: str, attempt: Any) -> Any:
        """Call `attempt(try_index)` until it succeeds, with exponential backoff on _Transient."""
        failures: list[str] = []
        for index in range(self._config.retries + 1):
            if index:
                delay = min(self._max_backoff_s, self._backoff_s * 2 ** (index - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            try:
                return await attempt(index)
            except _Transient as exc:
                failures.append(str(exc))
                logger.warning("%s failed (try %d of %d): %s", what, index + 1, self._config.retries + 1, exc)
        raise SGLangUnavailableError(
            f"{what} failed {len(failures)} times (rollout.sglang.retries={self._config.retries}); last error: "
            f"{failures[-1]}"
        )

    async def _call(self, method: str, url: str, *, json: Any = None, timeout: float | None = None) -> httpx.Response:
        async def attempt(_: int) -> httpx.Response:
            async with self._slots:
                return await self._attempt(method, url, json=json, timeout=timeout)

        return await self._with_retries(f"{method} {url}", attempt)

    # -- health and weights --------------------------------------------------------------------

    async def _wait_healthy(self, urls: list[str], *, router: str | None = None) -> None:
        """Poll each server's /health until all answer 200, or fail after health_timeout_s.

        The router answers /health as soon as it is up, before it has registered a worker (its
        /generate then answers 503); its /health_generate answers 200 once it routes to one.
        """
        timeout = self._config.health_timeout_s
        deadline = time.monotonic() + timeout
        paths = {url: "/health" for url in urls} | ({router: "/health_generate"} if router else {})
        last: dict[str, str] = {url: "no answer yet" for url in paths}

        async def poll(url: str) -> None:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    response = await self._client.get(f"{url}{paths[url]}", timeout=min(5.0, max(remaining, 0.05)))
                    if response.status_code == 200:
                        last.pop(url)
                        return
                    last[url] = f"HTTP {response.status_code}"
                except httpx.TransportError as exc:
                    last[url] = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(min(_HEALTH_POLL_S, max(deadline - time.monotonic(), 0)))

        await asyncio.gather(*(poll(url) for url in paths))
        if last:
            details = "; ".join(
                f"{url if paths[url] == '/health' else url + paths[url]} ({why})" for url, why in last.items()
            )
            raise SGLangUnavailableError(
                f"SGLang servers not healthy after {timeout:g}s (rollout.sglang.health_timeout_s): {details}"
            )

    async def _server_versions(self) -> dict[str, str]:
        async def one(url: str) -> str:
            info = (await self._call("GET", f"{url}/get_model_info")).json()
            if "weight_version" not in info:
                raise SGLangProtocolError(f"{url}/get_model_info has no weight_version: {info}")
            return str(info["weight_version"])

        versions = await asyncio.gather(*(one(url) for url in self._urls))
        return dict(zip(self._urls, versions, strict=True))

    async def _check_versions(self, expected: str) -> None:
        wrong = {url: v for url, v in (await self._server_versions()).items() if v != expected}
        if wrong:
            raise SGLangWeightVersionError(
                f"servers report other weights than the loaded {expected!r}: "
                + ", ".join(f"{url} has {v!r}" for url, v in wrong.items())
            )

    async def _sync_weights(self, checkpoint_dir: str, *, force: bool) -> None:
        """Make every server hold `checkpoint_dir`: update from disk, verify the version, flush."""
        version = checkpoint_weight_version(checkpoint_dir)
        model_path = str(Path(checkpoint_dir).resolve())
        if not force and all(v == version for v in (await self._server_versions()).values()):
            self._weight_version = version
            logger.info("SGLang servers already hold %s (%s)", model_path, version)
            return
        started = time.perf_counter()
        body = {"model_path": model_path, "weight_version": version, "abort_all_requests": False}

        async def update(url: str) -> None:
            response = await self._call(
                "POST", f"{url}/update_weights_from_disk", json=body, timeout=self._weight_update_timeout_s
            )
            answer = response.json()
            if answer.get("success") is not True:
                raise SGLangRequestError(
                    method="POST", url=f"{url}/update_weights_from_disk", status=response.status_code,
                    message=str(answer.get("message", answer)),
                )

        self._weight_version = ""  # unusable until every server is verified on the new version
        await asyncio.gather(*(update(url) for url in self._urls))
        await self._check_versions(version)
        await asyncio.gather(*(self._call("POST", f"{url}/flush_cache") for url in self._urls))
        self._weight_version = version
        logger.info(
            "SGLang servers loaded %s as %s in %.1fs", model_path, version, time.perf_counter() - started
        )

    # -- generation ----------------------------------------------------------------------------

    def _pick_url(self) -> str:
        url = self._data_urls[self._next % len(self._data_urls)]
        self._next += 1
        return url

    async def _generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        top_k: int,
        seed: int,
        progress: bool,
    ) -> list[list[Generation]]:
        from tqdm.auto import tqdm

        if not self._weight_version:
            raise SGLangWeightVersionError("no verified weights are loaded (a weight update failed)")
        if not prompts:
            return []
        await self._check_versions(self._weight_version)
        if self._check_logprobs and temperature > 0:
            unprobed = [url for url in self._urls if url not in self._probed]
            await asyncio.gather(*(self._probe_logprobs(url, prompts[0]) for url in unprobed))

        bar = tqdm(total=len(prompts), desc="rollout", unit="prompt", disable=not progress)

        async def group(i: int) -> list[Generation]:
            result = await self._generate_group(
                i, prompts[i], n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids, top_k=top_k, seed=seed,
            )
            bar.update(1)
            return result

        try:
            return list(await asyncio.gather(*(group(i) for i in range(len(prompts)))))
        finally:
            bar.close()

    async def _generate_group(
        self,
        prompt_index: int,
        prompt: list[int],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        top_k: int,
        seed: int,
    ) -> list[Generation]:
        params = []
        for j in range(n):
            p: dict[str, Any] = {
                "temperature": temperature,
                "top_p": top_p,
                "max_new_tokens": max_new_tokens,
                "stop_token_ids": stop_token_ids,
            }
            if temperature > 0:  # greedy needs no seed (and flashinfer rejects seeds with top_k=1)
                p["sampling_seed"] = sample_seed(seed, prompt_index, j)
            params.append(p)
        common = {
            "return_logprob": True,
            "top_logprobs_num": top_k,
            "logprob_start_len": -1,
            "return_text_in_logprobs": False,
            "stream": False,
        }
        if self._router_url is None:
            bodies = [{"input_ids": [prompt] * n, "sampling_params": params, **common}]
        else:  # the router's /generate takes one sampling_params object: one request per sample
            bodies = [{"input_ids": prompt, "sampling_params": p, **common} for p in params]
        expected = self._weight_version

        async def post(url: str, body: dict[str, Any]) -> list[Any]:
            async with self._slots:
                response = await self._attempt("POST", f"{url}/generate", json=body)
            answer = response.json()
            batch = len(body["sampling_params"]) if isinstance(body["sampling_params"], list) else None
            if batch is None:
                if not isinstance(answer, dict):
                    raise SGLangProtocolError(
                        f"{url}/generate answered a single request with {type(answer).__name__}"
                    )
                return [answer]
            if not isinstance(answer, list) or len(answer) != batch:
                raise SGLangProtocolError(
                    f"{url}/generate answered a batch of {batch} with "
                    f"{len(answer) if isinstance(answer, list) else type(answer).__name__}"
                )
            return answer

        async def attempt(_: int) -> list[Generation]:
            url = self._pick_url()
            outputs = [out for answer in await asyncio.gather(*(post(url, b) for b in bodies)) for out in answer]
            return [
                self._parse(out, url=url, expected_version=expected, stop_token_ids=stop_token_ids, top_k=top_k)
                for out in outputs
            ]

        return await self._with_retries(f"generate for prompt {prompt_index}", attempt)

    def _parse(
        self, out: dict[str, Any], *, url: str, expected_version: str, stop_token_ids: list[int], top_k: int
    ) -> Generation:
        """One `/generate` answer -> Generation, in the embedded engine's conventions."""
        meta = out.get("meta_info")
        if not isinstance(meta, dict):
            raise SGLangProtocolError(f"{url}/generate answer has no meta_info: {str(out)[:300]}")
        reported = meta.get("weight_version")
        if reported is not None and reported != expected_version:
            raise SGLangWeightVersionError(
                f"{url} answered with weights {reported!r}, expected {expected_version!r}"
            )
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or "type" not in finish:
            raise SGLangProtocolError(f"{url}/generate answer has no finish_reason: {meta}")
        if finish["type"] == "abort":
            raise _Transient(f"{url} aborted the request: {finish.get('message', finish)}")
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
        sampled = np.array([_logprob(entry[0]) for entry in token_logprobs], dtype=np.float32)  # [T]

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
            topk_logprobs = np.array([[_logprob(e[0]) for e in row] for row in top], dtype=np.float32)  # [T, K]
        else:
            topk_ids = np.zeros((num_tokens, 0), dtype=np.int32)
            topk_logprobs = np.zeros((num_tokens, 0), dtype=np.float32)

        return Generation(
            response_ids=response_ids,
            sampled_logprobs=sampled,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            finish_reason=self._finish_reason(finish, response_ids, stop_token_ids, url=url),
        )

    def _finish_reason(
        self, finish: dict[str, Any], response_ids: list[int], stop_token_ids: list[int], *, url: str
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
        if matched not in stop_token_ids and matched not in self._warned_eos:
            self._warned_eos.add(matched)
            logger.warning(
                "%s stopped on token %d, not in stop_token_ids %s (the model's own EOS); reported as 'stop'",
                url, matched, stop_token_ids,
            )
        return "stop"

    async def _probe_logprobs(self, url: str, prompt: list[int]) -> None:
        """Fail if `url` returns log-probs after temperature / top-p instead of the raw ones."""

        async def first_token_top(temperature: float, top_p: float) -> dict[int, float]:
            body = {
                "input_ids": prompt,
                "sampling_params": {"temperature": temperature, "top_p": top_p, "max_new_tokens": 1},
                "return_logprob": True,
                "top_logprobs_num": _PROBE_TOP_K,
                "logprob_start_len": -1,
            }
            out = (await self._call("POST", f"{url}/generate", json=body)).json()
            row = out["meta_info"]["output_top_logprobs"][0]
            return {int(e[1]): _logprob(e[0]) for e in row}

        raw = await first_token_top(1.0, 1.0)
        processed = await first_token_top(2.0, 0.5)
        shared = sorted(set(raw) & set(processed))
        gap = max(abs(raw[t] - processed[t]) for t in shared) if shared else float("inf")
        if gap > _PROBE_TOLERANCE:
            raise SGLangLogprobError(
                f"{url} returns log-probs of the processed distribution (top-{_PROBE_TOP_K} at temperature 2, "
                f"top_p 0.5 differ from temperature 1 by {gap:.3g}); start the server with "
                "SGLANG_RETURN_ORIGINAL_LOGPROB=1 (infra/sglang/launch.sh does)"
            )
        self._probed.add(url)


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"SGLang server URL must start with http:// or https://, got {url!r}")
    return url


def _logprob(value: Any) -> float:
    """SGLang serialises -inf log-probs as null (JSON has no infinities)."""
    return float("-inf") if value is None else float(value)


def _server_message(response: httpx.Response) -> str:
    """The error text of an SGLang answer: {"error": {"message"}}, {"message"}, or the raw body."""
    text = response.text
    try:
        body = response.json()
    except ValueError:
        return text.strip()[:2000] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in body:
            return str(body["message"])
    return text.strip()[:2000]
