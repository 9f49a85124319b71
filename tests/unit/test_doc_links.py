"""Every relative link of the Markdown docs points at a file that exists, and every `#anchor` at a
heading of its target (as GitHub names a heading's anchor)."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "``", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, root: Path) -> list[str]:
    problems = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: ({target})"
            if not dest.exists():
                problems.append(f"{where}: {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {dest.relative_to(root)} has no heading with anchor #{anchor}")
    return problems


def markdown_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / name for name in listed if (REPO / name).is_file()]


def test_the_docs_are_found():
    names = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    assert {"README.md", "CONTRIBUTING.md", "docs/benchmarks.md", "docs/configuration.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path):
    assert broken_links(path, REPO) == []


def test_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## GPU: one iteration against TRL\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "a.md"
    doc.write_text(
        "[ok](docs/b.md#gpu-one-iteration-against-trl) [second](docs/b.md#twice-1) [self](#a)\n"
        "# A\n"
        "[gone](docs/c.md) [no heading](docs/b.md#gpu-one-iteration) ![img](docs/missing.png)\n"
        "`[in code](docs/nowhere.md)`\n```\n[in a fence](docs/nowhere.md)\n```\n[web](https://example.com/x)\n"
    )
    problems = broken_links(doc, tmp_path)
    assert len(problems) == 3, problems
    assert "docs/c.md does not exist" in problems[0]
    assert "no heading with anchor #gpu-one-iteration" in problems[1]
    assert "docs/missing.png does not exist" in problems[2]


def test_anchors_follow_githubs_rules():
    assert slug("The viewer: `sdpo view`") == "the-viewer-sdpo-view"
    assert slug("Asynchronous iterations: `max_staleness` 1 against 0") == (
        "asynchronous-iterations-max_staleness-1-against-0"
    )
    assert slug("GPU: the pipeline on the 1.7B shape") == "gpu-the-pipeline-on-the-17b-shape"
    assert slug("Beside TRL's SDPOTrainer (`make bench-trl`)") == "beside-trls-sdpotrainer-make-bench-trl"
    assert slug("3. On-policy against one iteration of staleness") == "3-on-policy-against-one-iteration-of-staleness"
