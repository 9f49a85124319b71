"""URL handling: the one place that turns a URL or plain path into an fsspec filesystem.

Supported: `file://` (the default: a plain path means a local path), `s3://` through s3fs, and
`memory://` for tests. For `s3://`, `storage_options` are s3fs arguments (`endpoint_url`, `key`,
`secret`, `token`, `client_kwargs={"region_name": ...}`, `config_kwargs={...}`); anything left out
comes from the standard AWS environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN`, `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`). Storage options are
never logged nor written to any file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, get_args

import fsspec
from fsspec import AbstractFileSystem

Backend = Literal["file", "s3", "memory"]
SUPPORTED_PROTOCOLS: tuple[Backend, ...] = get_args(Backend)


def protocol(url: str) -> Backend:
    """The URL scheme; a plain path is `file`."""
    if "://" not in url:
        return "file"
    scheme = url.split("://", 1)[0]
    for backend in SUPPORTED_PROTOCOLS:
        if scheme == backend:
            return backend
    raise ValueError(f"unsupported storage URL {url!r}: scheme {scheme!r} is not one of {SUPPORTED_PROTOCOLS}")


def normalize(url: str) -> str:
    """Canonical form: `file:///abs/path`, `s3://bucket/prefix`, `memory:///prefix`, no trailing slash."""
    scheme = protocol(url)
    if scheme == "file":
        path = url[len("file://") :] if url.startswith("file://") else url
        return "file://" + os.path.abspath(os.path.expanduser(path))
    rest = url.split("://", 1)[1].strip("/")
    if scheme == "s3":
        if not rest:
            raise ValueError(f"s3 URL {url!r} names no bucket")
        return f"s3://{rest}"
    return f"memory:///{rest}" if rest else "memory://"


def join(url: str, *parts: str) -> str:
    """`url` + "/" + parts; parts may not be empty, absolute or contain `..`."""
    base = normalize(url)
    for part in parts:
        pieces = part.split("/")
        if not part or part.startswith("/") or any(p in ("", ".", "..") for p in pieces):
            raise ValueError(f"bad path component {part!r} to join onto {base!r}")
    if base == "memory://":
        return "memory:///" + "/".join(parts)
    return "/".join([base, *parts])


_REGISTERED_OPTIONS: dict[str, dict[str, Any]] = {}


def register_options(root_url: str, storage_options: Mapping[str, Any]) -> None:
    """Use `storage_options` for every URL under `root_url` in this process.

    A run's flows and tasks pass only URLs (Prefect records task parameters, and options may hold
    credentials); the entry point registers the options of the run root once, here.
    """
    _REGISTERED_OPTIONS[normalize(root_url)] = dict(storage_options)


def registered_options(url: str) -> dict[str, Any] | None:
    """The options registered for the longest root that contains `url`, if any."""
    canonical = normalize(url)
    best: str | None = None
    for root in _REGISTERED_OPTIONS:
        if (canonical == root or canonical.startswith(root.rstrip("/") + "/")) and (
            best is None or len(root) > len(best)
        ):
            best = root
    return None if best is None else dict(_REGISTERED_OPTIONS[best])


def resolve(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """(filesystem, path inside it) for `url`; options default to those registered for its root.

    On s3 the listings cache is off unless asked for: several processes share a run and a stale
    listing would hide another writer's lock or manifest.
    """
    canonical = normalize(url)
    if storage_options is None:
        storage_options = registered_options(canonical)
    options = dict(storage_options or {})
    if protocol(canonical) == "s3":
        options.setdefault("use_listings_cache", False)
    fs, path = fsspec.core.url_to_fs(canonical, **options)
    return fs, path
