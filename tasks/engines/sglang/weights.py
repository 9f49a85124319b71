"""Which weights the SGLang servers hold: checkpoint versions, weight updates, the log-prob probe.

- **Weights.** `WeightSync.sync` posts `/update_weights_from_disk` to every worker with the
  checkpoint's local path (which every server must be able to read) and a `weight_version`
  derived from the checkpoint (`checkpoint_weight_version`), then checks each server's
  `/get_model_info` and flushes the cache. Before each `generate` every server is asked its
  version again (and the client compares every answer's `meta_info.weight_version` too): a
  server on other weights is an error, never used.
- **Log-probs.** For sampled (temperature > 0) requests SGLang returns log-probs of the processed
  distribution (after temperature) unless the server runs with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`;
  greedy requests always get the raw `log_softmax`. There is no per-request switch, so the launch
  script sets the variable, and `WeightSync.probe_logprobs` checks it once per server: it asks for
  the first token's top-K at temperature 1 and at temperature 2 (top-p 0.5) and fails if they
  differ.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol

import httpx

from tasks.engines.sglang.errors import (
    SGLangLogprobError,
    SGLangProtocolError,
    SGLangRequestError,
    SGLangWeightVersionError,
)
from tasks.engines.sglang.schema import logprob

__all__ = ["Call", "WeightSync", "checkpoint_weight_version"]

logger = logging.getLogger(__name__)

_PROBE_TOP_K = 8
_PROBE_TOLERANCE = 0.05  # log-prob units; tempering at T=2 moves real distributions far more
_DIGEST_DIR = re.compile(r"[0-9a-f]{64}")


class Call(Protocol):
    """The client's HTTP request with retries (`SGLangEngine._call`)."""

    def __call__(
        self, method: str, url: str, *, json: Any = None, timeout: float | None = None
    ) -> Awaitable[httpx.Response]: ...


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


class WeightSync:
    """The weights the worker servers `urls` hold, loaded and verified through `call`."""

    def __init__(self, urls: list[str], call: Call, *, update_timeout_s: float) -> None:
        self._urls = list(urls)
        self._call = call
        self._update_timeout_s = update_timeout_s
        self._probed: set[str] = set()
        self._version = ""

    @property
    def version(self) -> str:
        """The verified version every server holds; "" until verified (or after a failed update)."""
        return self._version

    async def server_versions(self) -> dict[str, str]:
        """Each worker's `weight_version`, from its `/get_model_info`."""

        async def one(url: str) -> str:
            info = (await self._call("GET", f"{url}/get_model_info")).json()
            if "weight_version" not in info:
                raise SGLangProtocolError(f"{url}/get_model_info has no weight_version: {info}")
            return str(info["weight_version"])

        versions = await asyncio.gather(*(one(url) for url in self._urls))
        return dict(zip(self._urls, versions, strict=True))

    async def check_versions(self, expected: str) -> None:
        """Fail naming every server whose weights are not `expected`."""
        wrong = {url: v for url, v in (await self.server_versions()).items() if v != expected}
        if wrong:
            raise SGLangWeightVersionError(
                f"servers report other weights than the loaded {expected!r}: "
                + ", ".join(f"{url} has {v!r}" for url, v in wrong.items())
            )

    async def sync(self, checkpoint_dir: str, *, force: bool) -> None:
        """Make every server hold `checkpoint_dir`: update from disk, verify the version, flush.

        Without `force`, servers that all hold it already are left alone.
        """
        version = checkpoint_weight_version(checkpoint_dir)
        model_path = str(Path(checkpoint_dir).resolve())
        if not force and all(v == version for v in (await self.server_versions()).values()):
            self._version = version
            logger.info("SGLang servers already hold %s (%s)", model_path, version)
            return
        started = time.perf_counter()
        body = {"model_path": model_path, "weight_version": version, "abort_all_requests": False}

        async def update(url: str) -> None:
            response = await self._call(
                "POST", f"{url}/update_weights_from_disk", json=body, timeout=self._update_timeout_s
            )
            answer = response.json()
            if answer.get("success") is not True:
                raise SGLangRequestError(
                    method="POST",
                    url=f"{url}/update_weights_from_disk",
                    status=response.status_code,
                    message=str(answer.get("message", answer)),
                )

        self._version = ""  # unusable until every server is verified on the new version
        await asyncio.gather(*(update(url) for url in self._urls))
        await self.check_versions(version)
        await asyncio.gather(*(self._call("POST", f"{url}/flush_cache") for url in self._urls))
        self._version = version
        logger.info("SGLang servers loaded %s as %s in %.1fs", model_path, version, time.perf_counter() - started)

    async def probe_logprobs(self, prompt: list[int]) -> None:
        """Fail if a server not probed yet returns log-probs after temperature / top-p, not the raw ones."""
        await asyncio.gather(*(self._probe(url, prompt) for url in self._urls if url not in self._probed))

    async def _probe(self, url: str, prompt: list[int]) -> None:
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
            return {int(e[1]): logprob(e[0]) for e in row}

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
