from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.mark.parametrize(
    "command",
    [
        "run",
        "advance",
        "fork",
        "validate",
        "lineage",
        "status",
        "verify",
        "gc",
        "stage",
        "eval",
        "prepare-data",
        "view",
        "resume-schedule",
        "mlflow-ui",
    ],
)
def test_every_command_has_help(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_validate_prints_the_resolved_config_with_overrides():
    result = runner.invoke(app, ["validate", str(REPO / "configs" / "demo.yaml"), "loss.alpha=0.25"])
    assert result.exit_code == 0, result.output
    assert "alpha: 0.25" in result.output
    assert "update_rate: 0.05" in result.output  # defaults are shown too


def test_invalid_config_names_the_field_and_exits_2():
    result = runner.invoke(app, ["validate", str(REPO / "configs" / "demo.yaml"), "loss.divergence=sampled_token"])
    assert result.exit_code == 2
    assert "loss" in result.output and "alpha=1" in result.output


@pytest.mark.parametrize("ending", ["exit", "error"])
def test_a_command_ends_with_its_objects_frozen_for_the_interpreters_exit(monkeypatch, ending):
    """`main` freezes every live object after the command, returned or raised: the interpreter's
    collections at exit then skip what the command built (seconds for a process that trained)."""
    import gc
    import sys

    import flows.cli

    def command() -> None:
        if ending == "error":
            raise RuntimeError("the command failed")
        sys.exit(0)

    monkeypatch.setattr(flows.cli, "app", command)
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit if ending == "exit" else RuntimeError):
            flows.cli.main()
        assert gc.get_freeze_count() > 10_000
        assert not any(isinstance(o, type(command)) and o is command for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_the_installed_command_starts_in_main():
    """The `sdpo` console script enters through `flows.cli.main`, as `python -m flows.cli` does, so
    the heap settings and the freeze before exit apply to what users run too."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["sdpo"] == "flows.cli:main"
