"""`SGLangEngine`: the `RolloutEngine` that samples from SGLang servers over their native HTTP API.

One `generate` call sends one `/generate` request per prompt (`schema` builds and reads them) to
the servers of the `fleet`, at most `max_concurrency` at a time, each retried with exponential
backoff on connection errors, timeouts, 5xx answers and aborted requests; 4xx answers fail at
once. Before sampling, `weights` makes sure every server holds the loaded weights.

The `RolloutEngine` interface is synchronous; the client runs its coroutines on a private event
loop in a background thread, so it works from plain threads and from code that already runs an
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import httpx

from tasks.config import SGLangConfig
from tasks.engines.base import Generation, RolloutEngine, SamplingParams
from tasks.engines.sglang.errors import (
    SGLangRequestError,
    SGLangUnavailableError,
    SGLangWeightVersionError,
    TransientFailure,
)
from tasks.engines.sglang.fleet import ServerFleet
from tasks.engines.sglang.schema import answer_outputs, generate_bodies, parse_generation
from tasks.engines.sglang.weights import WeightSync

__all__ = ["SGLangEngine"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")


class SGLangEngine(RolloutEngine):
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
        self._fleet = ServerFleet(config.urls, router_url=router_url)
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s=}, {max_backoff_s=}")
        self._config = config
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._check_logprobs = check_logprobs
        self._weights = WeightSync(self._fleet.urls, self._call, update_timeout_s=weight_update_timeout_s)
        self._warned_eos: set[int] = set()
        self._closed = False
        self._client: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(config.max_concurrency)  # binds to the private loop on first use

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._run(self._make_client())
            self._run(self._fleet.wait_healthy(self._http, timeout_s=config.health_timeout_s, router=True))
            self._run(self._weights.sync(checkpoint_dir, force=False))
        except BaseException:
            self.close()
            raise

    # -- RolloutEngine -------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weights.version

    @property
    def urls(self) -> list[str]:
        return list(self._fleet.urls)

    def load_weights(self, checkpoint_dir: str, *, weights: Mapping[str, Any] | None = None) -> None:
        """Load an HF checkpoint into every server (waiting for restarted servers to be healthy); the
        servers read the folder, so weights in this process's memory are not used."""
        self._run(self._fleet.wait_healthy(self._http, timeout_s=self._config.health_timeout_s, router=False))
        self._run(self._weights.sync(checkpoint_dir, force=True))

    def _sample(self, prompts: list[list[int]], params: SamplingParams, *, progress: bool) -> list[list[Generation]]:
        return self._run(self._generate(prompts, params, progress=progress))

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

    @property
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the engine's HTTP client is not open")
        return self._client

    # -- HTTP with retries ---------------------------------------------------------------------

    async def _attempt(
        self, method: str, url: str, *, json: Any = None, timeout: float | None = None
    ) -> httpx.Response:
        """One try; 4xx raises SGLangRequestError at once, anything retryable raises TransientFailure."""
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            response = await self._http.request(method, url, json=json, **kwargs)
        except httpx.TransportError as exc:  # connection refused/reset, dropped mid-answer, timeouts
            raise TransientFailure(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise TransientFailure(f"HTTP {response.status_code}: {_server_message(response)}")
        if response.status_code >= 400:
            raise SGLangRequestError(
                method=method, url=url, status=response.status_code, message=_server_message(response)
            )
        return response

    async def _with_retries(self, what: str, attempt: Callable[[int], Awaitable[_R]]) -> _R:
        """Call `attempt(try_index)` until it succeeds, with exponential backoff on TransientFailure."""
        failures: list[str] = []
        for index in range(self._config.retries + 1):
            if index:
                delay = min(self._max_backoff_s, self._backoff_s * 2 ** (index - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            try:
                return await attempt(index)
            except TransientFailure as exc:
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

    # -- generation ----------------------------------------------------------------------------

    async def _generate(
        self, prompts: list[list[int]], params: SamplingParams, *, progress: bool
    ) -> list[list[Generation]]:
        from tqdm.auto import tqdm

        from tasks.progress_bars import bar_disabled

        if not self._weights.version:
            raise SGLangWeightVersionError("no verified weights are loaded (a weight update failed)")
        if not prompts:
            return []
        await self._weights.check_versions(self._weights.version)
        if self._check_logprobs and params.temperature > 0:
            await self._weights.probe_logprobs(prompts[0])

        bar = tqdm(total=len(prompts), desc="rollout", unit="prompt", disable=bar_disabled(progress))

        async def group(i: int) -> list[Generation]:
            result = await self._generate_group(i, prompts[i], params)
            bar.update(1)
            return result

        try:
            return list(await asyncio.gather(*(group(i) for i in range(len(prompts)))))
        finally:
            bar.close()

    async def _generate_group(self, prompt_index: int, prompt: list[int], params: SamplingParams) -> list[Generation]:
        bodies = generate_bodies(prompt_index, prompt, params, per_sample=self._fleet.router_url is not None)
        expected = self._weights.version

        async def post(url: str, body: dict[str, Any]) -> list[Any]:
            async with self._slots:
                response = await self._attempt("POST", f"{url}/generate", json=body)
            return answer_outputs(response.json(), body, url=url)

        async def attempt(_: int) -> list[Generation]:
            url = self._fleet.pick()
            outputs = [out for answer in await asyncio.gather(*(post(url, b) for b in bodies)) for out in answer]
            return [
                parse_generation(
                    out,
                    url=url,
                    expected_version=expected,
                    stop_token_ids=params.stop_token_ids,
                    top_k=params.top_k_logprobs,
                    warned_eos=self._warned_eos,
                )
                for out in outputs
            ]

        return await self._with_retries(f"generate for prompt {prompt_index}", attempt)


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
