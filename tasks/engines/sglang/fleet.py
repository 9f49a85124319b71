"""The SGLang servers a client speaks to: the workers, the optional router, health and server choice.

`urls` lists the worker servers: health, weight updates and version checks go to each of them.
Generation goes to them in turn (a retry goes to the next one), or all to the sglang-router when
one is given; the router balances over the workers but does not forward weight updates.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from tasks.engines.sglang.errors import SGLangUnavailableError

__all__ = ["ServerFleet", "normalize_url"]

_HEALTH_POLL_S = 0.25


def normalize_url(url: str) -> str:
    """`url` without surrounding blanks and trailing slashes; it must be http(s)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"SGLang server URL must start with http:// or https://, got {url!r}")
    return url


class ServerFleet:
    """The worker servers (`urls`) and the router in front of them (`router_url`, or None)."""

    def __init__(self, urls: list[str], *, router_url: str | None) -> None:
        if not urls:
            raise ValueError("SGLangConfig.urls is empty; list the SGLang server URLs")
        self.urls = [normalize_url(u) for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"SGLangConfig.urls has duplicates: {urls}")
        self.router_url = None if router_url is None else normalize_url(router_url)
        self._data_urls = [self.router_url] if self.router_url is not None else list(self.urls)
        self._next = 0

    def pick(self) -> str:
        """The server the next `/generate` goes to: the router, or the workers in turn."""
        url = self._data_urls[self._next % len(self._data_urls)]
        self._next += 1
        return url

    async def wait_healthy(self, client: httpx.AsyncClient, *, timeout_s: float, router: bool) -> None:
        """Poll each worker's /health (and with `router` the router) until all answer 200.

        Fails after `timeout_s`, naming each server that did not answer and why. The router
        answers /health as soon as it is up, before it has registered a worker (its /generate then
        answers 503); its /health_generate answers 200 once it routes to one.
        """
        deadline = time.monotonic() + timeout_s
        paths = {url: "/health" for url in self.urls}
        if router and self.router_url is not None:
            paths[self.router_url] = "/health_generate"
        last: dict[str, str] = {url: "no answer yet" for url in paths}

        async def poll(url: str) -> None:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    response = await client.get(f"{url}{paths[url]}", timeout=min(5.0, max(remaining, 0.05)))
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
                f"SGLang servers not healthy after {timeout_s:g}s (rollout.sglang.health_timeout_s): {details}"
            )
