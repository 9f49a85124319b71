"""`sdpo compare` on two real runs (SDPO and GRPO), and the evaluation's avg@n / pass@k in the store."""

from __future__ import annotations

from typer.testing import CliRunner

from tests.integration.runs import write_config


def test_compare_reads_two_runs_from_the_store_and_writes_the_plot(tmp_path, prefect_server):
    from flows.cli import app
    from flows.run import sdpo_run
    from storage.layout import RunLayout
    from storage.stages import read_eval

    overrides = ["iterations=1", "eval.sampled_n=4"]
    for name, loss in (("sdpo-a", "sdpo"), ("grpo-a", "grpo")):
        sdpo_run(str(write_config(tmp_path, name)), [*overrides, f"loss.type={loss}"])
    evals = {name: read_eval(RunLayout(str(tmp_path / "runs"), name), 1) for name in ("sdpo-a", "grpo-a")}
    for metrics in evals.values():
        # pass@k rises with k from avg@n (= pass@1) to the fraction of prompts with any correct answer
        assert metrics["eval/pass_at_1"] == metrics["eval/avg_at_4"]
        assert metrics["eval/pass_at_1"] <= metrics["eval/pass_at_2"] <= metrics["eval/pass_at_4"] <= 1.0
        assert metrics["eval/prompts"] == 6.0

    plot = tmp_path / "out" / "compare.png"
    result = CliRunner().invoke(
        app,
        ["compare", "sdpo-a", "grpo-a", "--root", str(tmp_path / "runs"), "--plot", str(plot)],
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("sdpo-a" in line and "grpo-a" in line for line in lines)
    assert any(line.startswith("│ loss ") and "sdpo" in line and "grpo" in line for line in lines)
    (row,) = [line for line in lines if line.startswith("│ pass@4 ")]
    assert [cell.strip() for cell in row.split("│")[2:4]] == [
        f"{evals[n]['eval/pass_at_4']:.3f}" for n in ("sdpo-a", "grpo-a")
    ]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    missing = CliRunner().invoke(app, ["compare", "sdpo-a", "nope", "--root", str(tmp_path / "runs")])
    assert missing.exit_code == 2 and "nope" in missing.output
