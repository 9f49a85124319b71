"""Where a run config's values come from: the YAML file (with the line of every key), overrides,
and the checks that run before the values are validated: credentials refused, verifier arguments
known. Imports only PyYAML (and, for verifier signatures, the verifiers themselves)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CREDENTIALS_GO",
    "MAX_DEPTH",
    "ConfigError",
    "check_depth",
    "parse_value",
    "read_yaml",
    "refuse_credentials",
    "verifier_parameters",
    "where",
]

# What every error about a credential in a config says to do instead.
CREDENTIALS_GO = (
    "credentials never go in the run config or an override: put them in the environment "
    "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN for the store; MLFLOW_TRACKING_USERNAME "
    "and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, for a tracking server; HF_TOKEN for the hub) "
    "or in a named profile of the AWS config files (storage.storage_options.profile)"
)


class ConfigError(ValueError):
    """A run config that cannot be used; the message names each bad field and the fix."""


# The deepest a config nests (its sections take 4 levels; free-form values a few more). Deeper input
# is refused before anything recursive (YAML's composer, JSON, pydantic) walks it.
MAX_DEPTH = 32


def where(lines_of: dict[str, str], dotted: str) -> str:
    """file:line of `dotted` (or of the closest enclosing key) when it came from the YAML file or an
    override; a key inside a list (`a.b[0].c`) falls back to the list's own key. A mapping that
    overrides added keys to names them too: its value is the file's merged with theirs."""
    overridden = sorted(
        {place for key, place in lines_of.items() if key.startswith(dotted + ".") and place.startswith("override")}
    )
    if overridden:
        own = lines_of.get(dotted)
        return ", ".join(([own] if own is not None and own not in overridden else []) + overridden)
    keys = dotted.split(".")
    for n in range(len(keys), 0, -1):
        prefix = ".".join(keys[:n])
        found = lines_of.get(prefix) or lines_of.get(re.sub(r"\[\d+\]", "", prefix))
        if found is not None:
            return found
    return ""


def _credential_problem(key: str, value: Any) -> str | None:
    """Why `key: value` of a config may carry a credential (`storage.credentials`: a key named like
    one holding text, a URL with a user, a query or a fragment, text shaped like a token), or None."""
    from storage.credentials import credential_name, credential_text, url_problem

    if credential_name(key) and _holds_text(value):
        return "looks like a credential"
    if isinstance(value, str):
        if "://" in value and (problem := url_problem(value, allowed_query=())) is not None:
            return f"is a URL that {problem}"
        return credential_text(value)
    return None


def _holds_text(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    if isinstance(value, dict):
        return any(_holds_text(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_text(v) for v in value)
    return False


def refuse_credentials(tree: Any, *, places: dict[str, str], key: str = "") -> None:
    """ConfigError for a credential-looking value anywhere in `tree` (the rules of
    `storage.credentials`, with no query allowed in a URL); names the key and where it was given
    (`places`: dotted key -> "file:line" or "override N"), never the value. A first filter, before
    the fields' own allow-lists, so that no error about a value echoes a credential."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            dotted = f"{key}.{k}" if key else str(k)
            what = _credential_problem(str(k), v)
            if what is not None:
                source = where(places, dotted) or "the config"
                raise ConfigError(f"{source}: {dotted} {what}; {CREDENTIALS_GO}")
            refuse_credentials(v, places=places, key=dotted)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            if isinstance(v, str) and (what := _credential_problem("", v)) is not None:
                source = where(places, key) or "the config"
                raise ConfigError(f"{source}: {key}[{i}] {what}; {CREDENTIALS_GO}")
            refuse_credentials(v, places=places, key=f"{key}[{i}]")


def _flow_depth(text: str) -> int:
    """How deep `[`/`{` nest in YAML text, brackets inside quotes aside (one linear pass)."""
    depth = deepest = 0
    quote = ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


def _too_deep(source: str, at: str = "") -> ConfigError:
    where_ = f" (at {at[:80]}{'...' if len(at) > 80 else ''})" if at else ""
    return ConfigError(
        f"{source}: nested deeper than {MAX_DEPTH} levels{where_}; a run config nests at most {MAX_DEPTH}"
    )


def check_depth(tree: Any, *, source: str, base: int = 0) -> None:
    """ConfigError naming `source` (and the key where it happens) for a tree nested deeper than
    MAX_DEPTH levels (`base`: the levels above it). Iterative: any depth is measured safely."""
    stack: list[tuple[Any, int, str]] = [(tree, base, "")]
    while stack:
        node, depth, key = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep(source, key)
        if isinstance(node, dict):
            stack += [(v, depth + 1, f"{key}.{k}" if key else str(k)) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, depth + 1, f"{key}[{i}]") for i, v in enumerate(node)]


def parse_value(raw: str, *, source: str, depth: int = 0) -> Any:
    """An override's value (YAML), refused with a ConfigError naming `source` when it is not YAML or
    nests past MAX_DEPTH levels (with the `depth` of its key): before YAML's recursive parser
    sees it, so no input makes it exceed Python's stack."""
    if depth + _flow_depth(raw) > MAX_DEPTH:
        raise _too_deep(source)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}: the value is not valid YAML ({problem})") from None
    except RecursionError:  # block nesting by indentation, which _flow_depth does not see
        raise _too_deep(source) from None
    check_depth(value, source=source, base=depth)
    return value


def _key_lines(node: yaml.Node, path: str, prefix: str, out: dict[str, str]) -> None:
    """Record the line of every key under `node`; ConfigError for a key given twice in one mapping
    (YAML would keep the last one without a word)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            dotted = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise ConfigError(
                        f"{path}:{line}: {dotted} is given twice (lines {seen[key_node.value]} and {line}); "
                        "keep one of them"
                    )
                seen[key_node.value] = line
            out[dotted] = f"{path}:{line}"
            _key_lines(value_node, path, dotted, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _key_lines(item, path, f"{prefix}[{i}]", out)


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
    if _flow_depth(text) > MAX_DEPTH:
        raise _too_deep(str(path))
    try:
        loaded = yaml.safe_load(text)
        node = yaml.compose(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}{line}: not valid YAML ({problem})") from None
    except RecursionError:  # block nesting by indentation
        raise _too_deep(str(path)) from None
    check_depth(loaded, source=str(path))
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
