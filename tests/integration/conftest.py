"""Integration fixtures: a real S3 API (moto's threaded server) on 127.0.0.1, a fault-injecting
proxy, and a real `prefect server`.

`s3_server` (session) serves S3 on a free port; `s3_root` is a fresh bucket per test as an
`s3://` URL, with `s3_options` the matching storage options. `fault_proxy` sits between s3fs and
moto and answers chosen requests with 5xx errors, stalls (client timeouts) or dropped connections.
`prefect` starts a `prefect server` of the test's own (tests/integration/prefect_server.py).
"""

from __future__ import annotations

import http.client
import http.server
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import boto3
import pytest
from moto.server import ThreadedMotoServer

REGION = "eu-west-1"  # not us-east-1: bucket creation there rejects a location constraint
CREDENTIALS = {"key": "testing", "secret": "testing"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: Any, log: Any, *, timeout: float) -> None:
    """Wait until GET `url` answers 200, failing with the log's tail if the server process `server`
    (a Popen writing to the file `log`) exits or `timeout` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not answer within {timeout:.0f} s:\n" + log.read_text()[-3000:])


@pytest.fixture
def prefect(tmp_path: Any) -> Iterator[Any]:
    """A `prefect server` of this test (`prefect_server.Prefect`); every process started through it
    is killed at the end."""
    from tests.integration.prefect_server import Prefect, kill_group

    p = Prefect(tmp_path / "prefect-home", _free_port())
    log = tmp_path / "server.log"
    server = p.start(["server", "start", "--host", "127.0.0.1", "--port", str(p.port)], log)
    try:
        wait_healthy(f"{p.url}/health", server, log, timeout=240)
        yield p
    finally:
        for proc in reversed(p.processes):
            kill_group(proc)


@dataclass
class S3Server:
    endpoint_url: str

    def storage_options(self, endpoint_url: str | None = None, **config: Any) -> dict[str, Any]:
        """s3fs options for this server; `config` goes to botocore's Config (timeouts, retries)."""
        return {
            "endpoint_url": endpoint_url or self.endpoint_url,
            **CREDENTIALS,
            "client_kwargs": {"region_name": REGION},
            "config_kwargs": config,
        }

    def make_bucket(self) -> str:
        name = f"test-{uuid.uuid4().hex[:16]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=CREDENTIALS["key"],
            aws_secret_access_key=CREDENTIALS["secret"],
        )
        client.create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": REGION})
        return name


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(endpoint_url=f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, Any]:
    return s3_server.storage_options()


@pytest.fixture
def s3_root(s3_server: S3Server) -> str:
    return f"s3://{s3_server.make_bucket()}/runs"


# -- fault injection --------------------------------------------------------------------------
FaultKind = Literal["500", "503", "timeout", "reset"]


@dataclass
class Fault:
    """Answer the next `times` requests matching `method` and `path_contains` with `kind`."""

    kind: FaultKind
    method: str | None = None
    path_contains: str | None = None
    times: int = 1
    stall_s: float = 2.0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.times > 0
            and (self.method is None or self.method == method)
            and (self.path_contains is None or self.path_contains in path)
        )


@dataclass
class FaultProxy:
    endpoint_url: str
    faults: list[Fault] = field(default_factory=list)
    injected: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, method, path)
    forwarded: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path, status)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inject(
        self,
        kind: FaultKind,
        *,
        method: str | None = None,
        path_contains: str | None = None,
        times: int = 1,
        stall_s: float = 2.0,
    ) -> None:
        """Answer the next `times` matching requests with `kind` (500, 503, timeout, reset)."""
        with self.lock:
            self.faults.append(Fault(kind, method, path_contains, times, stall_s))

    def take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.times -= 1
                    self.injected.append((fault.kind, method, path))
                    return fault
        return None


_ERROR_BODY = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "ServiceUnavailable", "Service is unable to handle the request."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


def _handler(proxy: FaultProxy, target: tuple[str, int]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    chunk = self.rfile.read(size)
                    self.rfile.readline()
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    chunks.append(chunk)
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _handle(self) -> None:
            body = self._read_body()
            fault = proxy.take(self.command, self.path)
            if fault is not None and fault.kind in _ERROR_BODY:
                status, code, message = _ERROR_BODY[fault.kind]
                payload = (
                    f'<?xml version="1.0" encoding="UTF-8"?>'
                    f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            if fault is not None:
                if fault.kind == "timeout":
                    time.sleep(fault.stall_s)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(*target, timeout=30)
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            conn.close()
            proxy.forwarded.append((self.command, self.path, response.status))
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP:
                    self.send_header(key, value)
            # HEAD answers carry the object's length but no body
            length = response.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    host, port = s3_server.endpoint_url.removeprefix("http://").split(":")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), None)  # type: ignore[arg-type]
    proxy = FaultProxy(endpoint_url=f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(proxy, (host, int(port)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="s3-fault-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
