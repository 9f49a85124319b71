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
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

SUPPORTED_PROTOCOLS = ("file", "s3", "memory")


def protocol(url: str) -> str:
    """The URL scheme; a plain path is `file`."""
    if "://" not in url:
        return "file"
    scheme = url.split("://", 1)[0]
    if scheme not in SUPPORTED_PROTOCOLS:
        raise ValueError(f"unsupported storage URL {url!r}: scheme {scheme!r} is not one of {SUPPORTED_PROTOCOLS}")
    return scheme


def normalize(url: str) -> str:
    """Canonical form: `file:///abs/path`, `s3://bucket/prefix`, `memory:///prefix`, no trailing slash."""
    scheme = protocol(url)
    if scheme == "file":
        path = url[len("file://"):] if url.startswith("file://") else url
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


def resolve(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """(filesystem, path inside it) for `url`.

    On s3 the listings cache is off unless asked for: several processes share a run and a stale
    listing would hide another writer's lock or manifest.
    """
    canonical = normalize(url)
    options = dict(storage_options or {})
    if protocol(canonical) == "s3":
        options.setdefault("use_listings_cache", False)
    fs, path = fsspec.core.url_to_fs(canonical, **options)
    return fs, path
