"""Hub model ids in `model.path`: what `tasks.hub` fetches, read without fetching anything.

`hub_model` tells a hub model (`hf://ORG/NAME[@REVISION][/FOLDER]`, or a bare `ORG/NAME[@REVISION]`
that is no storage URL and no existing local path) from a local path or storage URL, so the config
refuses a malformed `hf://` URL when it loads; `tasks.hub` fetches, checks and links the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tasks.config.source import ConfigError

__all__ = ["FIELD", "HubModel", "hub_model"]

FIELD = "model.path"
_BARE_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


@dataclass(frozen=True)
class HubModel:
    """A model repository of the hub, at a revision (None: the repository's default branch)."""

    repo_id: str
    revision: str | None
    folder: str  # inside the repository; "" for its top level

    @property
    def url(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.repo_id}{at}" + (f"/{self.folder}" if self.folder else "")

    def download_command(self) -> str:
        revision = f" --revision {self.revision}" if self.revision else ""
        return f"hf download {self.repo_id}{revision}"


def hub_model(path: str) -> HubModel | None:
    """The hub model `path` (a `model.path` value) names, or None for a local path or storage URL.
    ConfigError for an `hf://` URL that names no model repository."""
    from huggingface_hub import constants, parse_hf_uri
    from huggingface_hub.errors import HfUriError

    if path.startswith(constants.HF_PROTOCOL):
        uri = path
    elif "://" in path or Path(path).expanduser().exists() or not _BARE_ID.fullmatch(path):
        return None
    else:
        uri = constants.HF_PROTOCOL + path
    try:
        parsed = parse_hf_uri(uri)
    except HfUriError as err:
        raise ConfigError(f"{FIELD}={path!r} is not a hub model: {err}; write ORG/NAME[@REVISION]") from None
    if parsed.type != "model":
        raise ConfigError(
            f"{FIELD}={path!r} names a {parsed.type} repository of the hub; give a model repository, "
            "hf://ORG/NAME[@REVISION][/FOLDER]"
        )
    return HubModel(parsed.id, parsed.revision, parsed.path_in_repo.strip("/"))
