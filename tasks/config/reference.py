"""The configuration reference (docs/configuration.md), generated from the config classes.

Every field of the `RunConfig` tree, section by section: its dotted name, type, default, the
constraints pydantic checks on it, and its description. The classes are the only source: a field
added, renamed or given a new default changes the reference, and `tests/unit/test_config_reference.py`
fails until it is regenerated::

    python -m tasks.config.reference            # rewrites docs/configuration.md
    python -m tasks.config.reference --check    # exit 1 when the file is stale

The file's prose above `MARKER` is written by hand and kept as it is; everything below the marker
is generated.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic.fields import FieldInfo

from tasks.config.run import RunConfig
from tasks.config.section import Section
from tasks.config.urls import plain_url

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m tasks.config.reference"
MARKER = f"<!-- Generated below this line by `{COMMAND}` from tasks/config/: do not edit by hand. -->"


@dataclass(frozen=True)
class FieldRow:
    name: str  # dotted, from the root of the config
    type: str
    default: str
    constraints: str
    description: str


@dataclass(frozen=True)
class SectionDoc:
    path: str  # dotted; "" for the root
    cls: type[Section]
    optional: bool  # a section whose default is null (unset until given)
    rows: tuple[FieldRow, ...]


def type_name(annotation: Any) -> str:
    """A field's annotation as a reader writes it: `int`, `float | null`, `"a" | "b"`, `list[str]`."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    origin = get_origin(annotation)
    if origin is typing.Annotated:  # PlainUrl: a path, or a URL with no user, query or fragment
        base, *metadata = get_args(annotation)
        plain = any(getattr(item, "func", None) is plain_url for item in metadata)
        return "url (no user, query, fragment)" if plain else type_name(base)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _section_in(annotation: Any) -> type[Section] | None:
    """The config section a field holds, directly or as `Section | None`."""
    candidates = get_args(annotation) if get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    for arg in candidates:
        if isinstance(arg, type) and issubclass(arg, Section):
            return arg
    return None


def default_text(info: FieldInfo) -> str:
    """The default as it would be written in YAML flow style (JSON), or `required`."""
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def constraints_text(info: FieldInfo) -> str:
    """The bounds, lengths and patterns pydantic checks on the field's value."""
    out = []
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            out.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            out.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            out.append(f"<= {item.le}")
        elif isinstance(item, annotated_types.Lt):
            out.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.MinLen):
            out.append(f"at least {item.min_length} item(s)")
        elif isinstance(item, annotated_types.MaxLen):
            out.append(f"at most {item.max_length} item(s)")
        elif getattr(item, "pattern", None) is not None:
            out.append(f"matches `{item.pattern}`")
        else:
            raise ValueError(
                f"field metadata {item!r} has no rendering in tasks/config/reference.py; add one to constraints_text"
            )
    return ", ".join(out)


def walk(cls: type[Section] = RunConfig, path: str = "", *, optional: bool = False) -> Iterator[SectionDoc]:
    """Every section of the tree, depth first in declaration order, with its leaf fields."""
    rows = []
    children = []
    for name, info in cls.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        section = _section_in(info.annotation)
        if section is not None:
            children.append((section, dotted, info.get_default(call_default_factory=True) is None))
            continue
        rows.append(
            FieldRow(
                name=dotted,
                type=type_name(info.annotation),
                default=default_text(info),
                constraints=constraints_text(info),
                description=info.description or "",
            )
        )
    yield SectionDoc(path=path, cls=cls, optional=optional, rows=tuple(rows))
    for section, dotted, unset in children:
        yield from walk(section, dotted, optional=optional or unset)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _docstring(cls: type[Section]) -> str:
    doc = cls.__doc__ or ""
    if cls.__doc__ == Section.__doc__:
        return ""
    return " ".join(line.strip() for line in doc.strip().splitlines())


def render_reference() -> str:
    """The generated part of docs/configuration.md (everything below the marker)."""
    lines = [
        MARKER,
        "",
        "## Reference",
        "",
        "Every field of the tree, from the config classes in `tasks/config/`. Set a field in the YAML file "
        "or as a dotted override (`sdpo run CONFIG loss.alpha=1`). Every section refuses unknown keys and "
        "every float must be finite. Checks that span several fields (for example `train.packing` needs "
        "`train.attention: sdpa`) run when the config loads, and their errors name the fields to change.",
    ]
    for doc in walk():
        title = f"`{doc.path}`" if doc.path else "Top level"
        lines += ["", f"### {title}", ""]
        text = _docstring(doc.cls)
        if doc.optional:
            text = (text + " " if text else "") + "An optional section: unset (null) unless given."
        if text:
            lines += [text, ""]
        if not doc.rows:
            lines.append("Only the sections below.")
            continue
        lines += ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
        for row in doc.rows:
            cells = [f"`{row.name}`", f"`{row.type}`", f"`{row.default}`", row.constraints, row.description]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def prose_of(text: str) -> str:
    """The hand-written part of a reference file: everything above the marker (with its newline)."""
    if MARKER not in text:
        raise ValueError(f"{REFERENCE_PATH} has no generation marker; put this line after its prose:\n{MARKER}")
    return text.split(MARKER, 1)[0]


def expected_text(current: str) -> str:
    """The file as it should be: its hand-written prose, then the generated reference."""
    return prose_of(current) + render_reference()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=REFERENCE_PATH)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale; write nothing")
    args = parser.parse_args(argv)
    current = args.path.read_text(encoding="utf-8")
    expected = expected_text(current)
    if args.check:
        if current != expected:
            print(f"{args.path} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != expected:
        args.path.write_text(expected, encoding="utf-8")
        print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
