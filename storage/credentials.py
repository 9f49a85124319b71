"""The one scanner every record passes before it is written: credential-looking content stops the write.

A run config's fields are allow-lists (`tasks/config/`): URLs without a user or query, free-form
mappings with the names the product knows, credentials only from the environment or a named
profile. This is the last line behind them: run.json and config_changes.jsonl, the MLflow params,
tags and artifacts, the parameters of the flow runs Prefect stores and the Prefect artifacts each
pass `check_record` first, and what it refuses is never written (`CredentialInRecordError` names
the record and the field, never the value).

Credential-looking, once names are read after folding (NFKC: full-width letters; letters of other
scripts that look Latin, Cyrillic `ѕ` as `s`; case; separators and camel case as word breaks):
- a key naming a credential (a word starting `secret`, `passw`, `passphrase`, `pwd`, `token`,
  `auth`, `credential`, `cookie`, `bearer`, `signature`, `private`, or the word `key`, `sig`, `pw`,
  and `apikey`, `accesskey`, ...) that holds text;
- a URL, anywhere in a text, with a user (`http://TOKEN@host`), or with a query or fragment
  parameter outside `ALLOWED_QUERY` (the MLflow UI's `workflowType`), or a fragment that is not a
  plain path (`#/experiments/1`);
- text shaped like a known credential: an AWS access key id, a PEM private key, a JSON web token,
  a GitHub, Hugging Face, OpenAI or Slack token, an HTTP `Authorization` value.
Standard library only, so the config package can use the same rules without loading the store.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

__all__ = [
    "ALLOWED_QUERY",
    "CredentialInRecordError",
    "check_record",
    "credential_name",
    "credential_text",
    "fold",
    "url_problem",
    "words",
]

ALLOWED_QUERY = frozenset({"workflowType"})  # the MLflow UI's view, in the links records carry

# Letters of other scripts drawn like Latin ones (Cyrillic, Greek, a few others); NFKC leaves them.
_CONFUSABLE = str.maketrans(
    {
        **dict(zip("аеорсухѕіјԁһԛԝвкмнтпг", "aeopcyxsijdhqwbkmhtnr", strict=True)),
        **dict(zip("АВЕКМНОРСТХЅІЈУ", "ABEKMHOPCTXSIJY", strict=True)),
        **dict(zip("αοριτυνκχεɑℯ", "aopituvkxeae", strict=True)),
        **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧ", "ABEZHIKMNOPTYX", strict=True)),
    }
)
_PREFIXES = (
    "secret",
    "passw",
    "passphrase",
    "pwd",
    "token",
    "auth",
    "credential",
    "cookie",
    "bearer",
    "signature",
    "private",
    "apikey",
    "accesskey",
    "secretkey",
    "privatekey",
    "sessionkey",
)
_WORDS = frozenset({"key", "keys", "sig", "pw", "pass", "cred", "creds", "sas", "jwt", "otp", "pin"})
_URL = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://([^\s\"'<>()\[\]{}`|\\^@/]*@)?(\[[0-9A-Fa-f:.]+\])?[^\s\"'<>()\[\]{}`|\\^]*"
)
_PLAIN_FRAGMENT = re.compile(r"[A-Za-z0-9/_.~-]*")
_SHAPES = (
    re.compile(r"\b(AKIA|ASIA|AIDA|AROA)[A-Z0-9]{16}\b"),  # AWS access key id
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\."),  # a JSON web token
    re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    re.compile(r"\bsk-(proj-)?[A-Za-z0-9_-]{20,}"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"),
    re.compile(r"\b(Bearer|Basic)\s+(?=[A-Za-z+/=._~-]*[0-9])[A-Za-z0-9+/=._~-]{16,}"),
)


class CredentialInRecordError(ValueError):
    """A record about to be written holds something that looks like a credential: the write is
    stopped. The message names the record and the field, never the value."""

    def __init__(self, record: str, field: str, what: str) -> None:
        super().__init__(
            f"{record}: {field or '<the record>'} {what}, so it is not written. Credentials never go in a "
            "run config: put them in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, HF_TOKEN) or in "
            "a named profile of the AWS config files (storage.storage_options.profile)"
        )
        self.record, self.field = record, field


def fold(text: str) -> str:
    """`text` as the scanner reads it: NFKC, look-alike letters of other scripts as Latin, accents off."""
    text = unicodedata.normalize("NFKC", text).translate(_CONFUSABLE)
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))


def words(name: str) -> list[str]:
    """A name's lower-case words, after folding: `secretAccessKey`, `SECRET-ACCESS-KEY` and
    `ＳＥＣＲＥＴ_access_key` all read `secret`, `access`, `key`."""
    split = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", fold(name))
    split = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", split)
    return [w for w in re.split(r"[^a-z0-9]+", split.lower()) if w]


def credential_name(name: str) -> bool:
    """Whether a key names a credential, however it is spelled (see the module doc)."""
    found = words(name)
    joined = "".join(found)
    return (
        any(w.startswith(_PREFIXES) or w in _WORDS for w in found)
        or any(stem in joined for stem in ("secret", "password", "passwd", "apikey", "accesskey", "privatekey"))
        or joined.endswith("key")
    )


def url_problem(url: str, *, allowed_query: Iterable[str] = ALLOWED_QUERY) -> str | None:
    """Why a URL may carry a credential, as "has ..." (a user, a query or fragment parameter not
    allowed, a fragment that is not a plain path), or None."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "has a user (userinfo)"
    allowed = set(allowed_query)
    fragment_path, _, fragment_query = parts.fragment.partition("?")
    for query in (parts.query, fragment_query):
        names = [name for name, _ in parse_qsl(query, keep_blank_values=True)] or ([query] if query else [])
        if any(name not in allowed for name in names):
            return f"has query values other than {', '.join(sorted(allowed))}" if allowed else "has a query"
    if not _PLAIN_FRAGMENT.fullmatch(fragment_path):
        return "has a fragment that is not a plain path"
    return None


def credential_text(text: str) -> str | None:
    """Why a text looks like it carries a credential (a URL that may, a known token shape), or None."""
    for match in _URL.finditer(text):
        if (problem := url_problem(match.group(0))) is not None:
            return f"holds a URL that {problem}"
    folded = fold(text)
    if any(shape.search(folded) for shape in _SHAPES):
        return "holds text shaped like a credential (a known token, key or Authorization value)"
    return None


def _holds_text(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, dict):
        return any(_holds_text(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_text(v) for v in value)
    return False


def check_record(tree: Any, *, record: str) -> None:
    """Stop the write of `record` (what it is and where it goes, e.g. "MLflow params of run X") when
    `tree` holds credential-looking content anywhere: CredentialInRecordError naming the field.
    Iterative, so any depth is scanned."""
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        field, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                dotted = f"{field}.{key}" if field else str(key)
                if credential_name(str(key)) and _holds_text(item):
                    raise CredentialInRecordError(record, dotted, "is named like a credential and holds text")
                if (problem := credential_text(str(key))) is not None:
                    raise CredentialInRecordError(record, dotted, f"is a key that {problem.removeprefix('holds ')}")
                stack.append((dotted, item))
        elif isinstance(value, list | tuple):
            stack += [(f"{field}[{i}]", item) for i, item in enumerate(value)]
        elif isinstance(value, str) and (problem := credential_text(value)) is not None:
            raise CredentialInRecordError(record, field, problem)
