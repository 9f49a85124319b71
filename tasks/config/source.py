"""Where a run config's values come from: the YAML file (with the line of every key), overrides,
and the checks that run before the values are validated: credentials refused, verifier arguments
known. Imports only PyYAML (and, for verifier signatures, the verifiers themselves)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ConfigError", "read_yaml", "refuse_credentials", "verifier_parameters", "where"]


class ConfigError(ValueError):
    """A run config that cannot be used; the message names each bad field and the fix."""


def where(lines_of: dict[str, str], dotted: str) -> str:
    """file:line of `dotted` (or of the closest enclosing key) when it came from the YAML file."""
    keys = dotted.split(".")
    for n in range(len(keys), 0, -1):
        found = lines_of.get(".".join(keys[:n]))
        if found is not None:
            return found
    return ""


# Keys whose string values are credentials wherever they appear; inside storage options and
# client kwargs also the short fsspec names.
_CREDENTIAL_KEY = re.compile(
    r"(^|_)(secret|secrets|password|passwd|token|api_?key|access_?key(_id)?|private_?key|credentials?)$", re.IGNORECASE
)
_CREDENTIAL_KEY_IN_OPTIONS = frozenset({"key", "secret", "token", "password"})
_URL_WITH_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")


def refuse_credentials(tree: Any, *, places: dict[str, str], key: str = "") -> None:
    """ConfigError for a credential-looking value anywhere in `tree`; names the key and where it was
    given (`places`: dotted key -> "file:line" or "override N"), never the value."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            dotted = f"{key}.{k}" if key else str(k)
            in_options = "storage_options" in key or "client_kwargs" in key
            named = _CREDENTIAL_KEY.search(str(k)) or (in_options and str(k).lower() in _CREDENTIAL_KEY_IN_OPTIONS)
            url = isinstance(v, str) and _URL_WITH_PASSWORD.match(v)
            if isinstance(v, str) and v and (named or url):
                source = where(places, dotted) or "the config"
                what = "is a URL with a password" if url else "looks like a credential"
                raise ConfigError(
                    f"{source}: {dotted} {what}; pass credentials through the environment (AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY, a credentials file), never in the run config or an override"
                )
            refuse_credentials(v, places=places, key=dotted)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            refuse_credentials(v, places=places, key=f"{key}[{i}]")


def _key_lines(node: yaml.Node, path: str, prefix: str, out: dict[str, str]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            out[dotted] = f"{path}:{key_node.start_mark.line + 1}"
            _key_lines(value_node, path, dotted, out)


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(tree, dotted key -> "file:line") of a YAML config; ConfigError naming the file on bad input."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); save the config as UTF-8"
        ) from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror})") from None
    try:
        loaded = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}{line}: not valid YAML ({problem})") from None
    if loaded is None:
        return {}, {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
    lines_of: dict[str, str] = {}
    _key_lines(node, str(path), "", lines_of)
    return loaded, lines_of


def verifier_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The keyword arguments the verifier `name` takes (for code: the sandbox limits too)."""
    from sdpo_core.verifiers import VERIFIERS

    if name == "code":
        from tasks.sandbox.program import verify_code as function
    else:
        function = VERIFIERS[name]
    params = {
        k: p for k, p in inspect.signature(function).parameters.items() if p.kind == p.KEYWORD_ONLY and k != "truncated"
    }
    if name == "code":
        from tasks.sandbox.program import SandboxLimits

        params.update(inspect.signature(SandboxLimits).parameters)
    return params
