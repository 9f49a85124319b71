"""Base models from the Hugging Face Hub: `model.path` as a hub id or an `hf://` URL.

`model.path` names a hub model when it is an `hf://` URL in the hub client's own syntax
(`hf://ORG/NAME[@REVISION][/FOLDER]`), or when it is no storage URL, no existing local path, and
reads `ORG/NAME[@REVISION]` (`Qwen/Qwen3-8B`, `Qwen/Qwen3-8B@main`). A local folder of that name
wins, as it does for `transformers`.

The model is fetched with `huggingface_hub.snapshot_download` into the hub client's cache, so the
client's environment applies as it does to every other hub tool: `HF_HOME` / `HF_HUB_CACHE` (where
the cache is), `HF_TOKEN`, `HF_ENDPOINT`, and `HF_HUB_OFFLINE`, under which nothing is requested and
the model must be in the cache already (`hf download ORG/NAME` on a machine that reaches the hub).
Only what a policy folder needs is fetched: the files at the top of the repository (or FOLDER)
named like configs, safetensors weights and tokenizer files. Checkpoint iter-0 is made of those
files, linked from the cache, and its manifest records the repository, the revision asked for and
the commit it resolved to (`metadata.hub`), so a run states which weights it started from.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Any

from storage.scratch import owner_tag
from tasks.config import ConfigError
from tasks.config.hub_ids import FIELD, HubModel, hub_model

__all__ = ["HubModel", "check_on_hub", "hub_model", "hub_snapshot", "policy_folder"]

logger = logging.getLogger(__name__)

# the top-level files of a policy folder: configs, weights, tokenizer files and chat templates
POLICY_FILES = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")


def _patterns(model: HubModel) -> tuple[list[str], list[str]]:
    """allow/ignore patterns of `snapshot_download` for the top-level policy files of the folder
    (the hub's patterns match across `/`, hence the ignore pattern for anything deeper)."""
    prefix = f"{model.folder}/" if model.folder else ""
    return [prefix + p for p in POLICY_FILES], [prefix + "*/*"]


def hub_snapshot(model: HubModel, *, cache_only: bool) -> Path | None:
    """The cached snapshot folder of `model`, downloaded first unless `cache_only` or the hub client
    is offline (`HF_HUB_OFFLINE`). None when `cache_only` and the cache does not hold it; ConfigError
    when it cannot be had, naming the field and what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.is_offline_mode()
    allow, ignore = _patterns(model)
    try:
        folder = snapshot_download(
            model.repo_id,
            revision=model.revision,
            allow_patterns=allow,
            ignore_patterns=ignore,
            local_files_only=cache_only or offline,
        )
    except LocalEntryNotFoundError as err:  # the cache lacks it (or holds part of it)
        if cache_only and not offline:
            return None
        raise ConfigError(
            f"{FIELD}={model.url!r}: the hub model is not in the hub cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE is set, so it cannot be downloaded; run `{model.download_command()}` where the hub "
            f"can be reached (with the same HF_HOME / HF_HUB_CACHE), or unset HF_HUB_OFFLINE ({err})"
        ) from None
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise _not_on_hub(model, err) from None
    return Path(folder) / model.folder


def _not_on_hub(model: HubModel, err: Exception) -> ConfigError:
    return ConfigError(
        f"{FIELD}={model.url!r}: the hub has no such model or revision, or it needs a token "
        f"(`hf auth login` or HF_TOKEN): {type(err).__name__}: {err}"
    )


def check_on_hub(model: HubModel) -> str | None:
    """Ask the hub (HF_ENDPOINT) whether `model`'s repository exists at its revision, for a model
    not in the hub cache: ConfigError when the hub says it does not (or that it needs a token),
    naming the address asked; None when it does; when the hub could not answer (unreachable, timed
    out after HF_HUB_ETAG_TIMEOUT seconds, an error of its own), what was tried and what happened."""
    import httpx2  # the hub client's HTTP library
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    asked = f"{constants.ENDPOINT}/api/models/{model.repo_id}" + (
        f"/revision/{model.revision}" if model.revision else ""
    )
    try:
        HfApi().model_info(model.repo_id, revision=model.revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise ConfigError(f"{_not_on_hub(model, err)} (asked {asked})") from None
    except HfHubHTTPError as err:
        return f"asked {asked}: the hub answered {type(err).__name__}: {err}"
    except httpx2.TransportError as err:
        return f"asked {asked}: no answer ({type(err).__name__}: {err})"
    return None


def policy_folder(model: HubModel, cache_dir: str) -> tuple[Path, dict[str, Any]]:
    """A local folder of `model`'s policy files (links into the hub cache, under `cache_dir/hub`),
    and what is known about it: `source` (the URL pinned to the commit) and `hub` (repository,
    revision asked for, commit)."""
    snapshot = hub_snapshot(model, cache_only=False)
    assert snapshot is not None
    commit = _commit_of(snapshot, model)
    files = sorted(p for p in snapshot.iterdir() if p.is_file() and any(p.match(g) for g in POLICY_FILES))
    names = [p.name for p in files]
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise ConfigError(
            f"{FIELD}={model.url!r}: the hub model at commit {commit} has no config.json and *.safetensors "
            f"weights at the top of {'folder ' + model.folder if model.folder else 'the repository'} (found: "
            f"{names or 'nothing'}); point at a repository (or hf://ORG/NAME/FOLDER) that holds a safetensors "
            f"model, or complete the cache with `{model.download_command()}`"
        )
    pinned = HubModel(model.repo_id, commit, model.folder)
    digest = hashlib.sha256(pinned.url.encode()).hexdigest()[:16]
    out = Path(cache_dir) / "hub" / f"{model.repo_id.replace('/', '--')}--{digest}"
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f"{out.name}.partial{owner_tag()}"
        tmp.mkdir()
        for path in files:
            (tmp / path.name).symlink_to(path.resolve())
        try:
            tmp.rename(out)  # atomic; another process linking the same commit may have won the race
        except OSError:
            shutil.rmtree(tmp)
    logger.info("hub model %s is commit %s (%d files, from %s)", model.url, commit, len(files), snapshot)
    hub = {"repo_id": model.repo_id, "revision": model.revision or "main", "commit": commit}
    if model.folder:
        hub["folder"] = model.folder
    return out, {"source": pinned.url, "hub": hub}


def _commit_of(snapshot: Path, model: HubModel) -> str:
    """The commit of a snapshot folder: the cache keeps each one as `snapshots/<commit>/`."""
    top = snapshot
    for _ in Path(model.folder).parts:
        top = top.parent
    if top.parent.name != "snapshots":
        raise RuntimeError(f"{top} is not a snapshot folder of the hub cache (`.../snapshots/<commit>`)")
    return top.name
