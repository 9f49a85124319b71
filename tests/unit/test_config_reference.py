"""docs/configuration.md's reference is generated from the config classes and kept current."""

import pytest
from pydantic import Field

from tasks.config import RunConfig
from tasks.config.reference import (
    COMMAND,
    MARKER,
    REFERENCE_PATH,
    expected_text,
    main,
    prose_of,
    render_reference,
    walk,
)
from tasks.config.section import Section


def test_docs_configuration_md_is_the_generated_reference():
    current = REFERENCE_PATH.read_text(encoding="utf-8")
    if current != expected_text(current):
        pytest.fail(
            f"{REFERENCE_PATH} is stale (a config field, default, constraint or description changed): "
            f"run `{COMMAND}` to regenerate it",
            pytrace=False,
        )


def test_every_leaf_field_of_the_tree_is_in_the_reference_once():
    def leaves(cls, prefix=""):
        for name, info in cls.model_fields.items():
            dotted = f"{prefix}{name}"
            nested = [a for a in (info.annotation, *getattr(info.annotation, "__args__", ())) if isinstance(a, type)]
            sections = [a for a in nested if issubclass(a, Section)]
            if sections:
                yield from leaves(sections[0], dotted + ".")
            else:
                yield dotted

    expected = list(leaves(RunConfig))
    documented = [row.name for doc in walk() for row in doc.rows]
    assert sorted(documented) == sorted(expected)
    text = render_reference()
    for name in expected:
        assert text.count(f"| `{name}` |") == 1, name
    assert {"loss.type", "loss.blend_lambda", "loss.srpo.beta", "launch.train.timeout_s"} <= set(documented)


def test_a_row_gives_type_default_constraints_and_description():
    rows = {row.name: row for doc in walk() for row in doc.rows}
    alpha = rows["loss.alpha"]
    assert (alpha.type, alpha.default, alpha.constraints) == ("float", "0.5", ">= 0, <= 1")
    assert "KL(teacher||student)" in alpha.description
    assert rows["loss.type"].type == '"sdpo" | "grpo" | "blend" | "srpo"'
    assert rows["loss.is_clip"].type == "float | null" and rows["loss.is_clip"].default == "2.0"
    assert rows["optimizer.betas"].default == "[0.9, 0.999]"
    assert rows["name"].constraints.startswith("matches `")
    assert rows["test_time.seeds"].constraints == "at least 1 item(s)"
    assert "| `loss.alpha` | `float` | `0.5` | >= 0, <= 1 | 0 = KL(teacher\\|\\|student)" in render_reference()


def test_a_changed_field_makes_the_file_stale(monkeypatch):
    from tasks.config.learning import LossConfig

    current = REFERENCE_PATH.read_text(encoding="utf-8")
    fields = dict(LossConfig.__pydantic_fields__)
    fields["alpha"] = Field(0.25, ge=0, le=1, description="changed")
    fields["alpha"].annotation = float
    monkeypatch.setattr(LossConfig, "__pydantic_fields__", fields)
    assert "| `loss.alpha` | `float` | `0.25` | >= 0, <= 1 | changed |" in render_reference()
    assert current != expected_text(current)


def test_the_prose_above_the_marker_is_kept(tmp_path, capsys):
    doc = tmp_path / "configuration.md"
    doc.write_text("# Configuration\n\nHand-written words.\n\n" + MARKER + "\nold reference\n", encoding="utf-8")
    assert main(["--path", str(doc), "--check"]) == 1
    assert f"is stale: run `{COMMAND}`" in capsys.readouterr().err
    assert main(["--path", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert prose_of(text) == "# Configuration\n\nHand-written words.\n\n"
    assert text.endswith(render_reference()) and "old reference" not in text
    assert main(["--path", str(doc), "--check"]) == 0


def test_a_file_without_the_marker_is_refused(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text("# Configuration\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no generation marker"):
        main(["--path", str(doc)])
