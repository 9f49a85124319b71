"""A seeded study: arms (override sets) x seeds of one config, run one after another, then summarised.

    .venv/bin/python benchmarks/study.py configs/study_arith.yaml --root runs/study \\
        --arm sdpo= --arm grpo=loss.type=grpo --seeds 0 1 2 [--plot study.png]

Each run is `sdpo run CONFIG name=<arm>-s<seed> seed=<seed> storage.root=ROOT <overrides>` as a
process (output in ROOT/<run>.log; `--set` adds overrides to every arm), so a study that is
interrupted resumes where it stopped (runs already finished are only read back). `--jobs N` runs N
at once, each logging to an MLflow store of its own (ROOT/mlflow-<run>.db) beside the study's. Then, from the store (`tasks.tracking.compare`): per arm, the final greedy accuracy,
avg@n and pass@n as mean ± standard deviation over seeds, the rollout response length, the seconds,
and for every arm the median over seeds of the first evaluated iteration at which a seed reached
the final greedy accuracy of the reference arm's run with the same seed (`--reference`, default
the last arm; a seed whose reference ended below the base model's accuracy counts as reached at 0); then, per arm,
the self-teacher's accuracy at each evaluation and its probability mass on the student's top-K ids;
then the answer length, the teacher's entropy, the SRPO routing and weights and the pass rate, over
the first and the last quarter of the iterations.
Prints both Markdown tables, writes a plot of each arm's curves (mean and range over seeds) and logs both to the study's MLflow store
(`<root>/mlflow.db`, experiment `sdpo`) as the artifacts of a run named `study-<config name>`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.tracking.compare import GREEDY, ROLLOUT_LENGTH, RunHistory, read_history, save_figure  # noqa: E402


def run_arm(config: Path, root: str, arm: str, overrides: list[str], seed: int, *, own_store: bool) -> None:
    """One run as a process; its output goes to <root>/<name>.log. `own_store`: the run logs to an
    MLflow store of its own (<root>/mlflow-<name>.db), since runs side by side would contend for
    one SQLite file."""
    name = f"{arm}-s{seed}"
    store = Path(root).resolve() / (f"mlflow-{name}.db" if own_store else "mlflow.db")
    command = [sys.executable, "-m", "flows.cli", "run", str(config), f"name={name}", f"seed={seed}"]
    command += [f"storage.root={root}", f"tracking.uri=sqlite:///{store}", *overrides]
    print("$", " ".join(command[2:]), flush=True)
    Path(root).mkdir(parents=True, exist_ok=True)
    with (Path(root) / f"{name}.log").open("a") as log:
        subprocess.run(command, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def first_reaching(history: RunHistory, target: float) -> int | None:
    reached = [n for n, m in sorted(history.evals.items()) if m.get(GREEDY, -1.0) >= target]
    return reached[0] if reached else None


def summarise(arms: dict[str, list[RunHistory]], reference: str, seeds: list[int]) -> str:
    finals = {a: [h.evals[max(h.evals)] for h in hs] for a, hs in arms.items()}
    targets = [f[GREEDY] for f in finals[reference]]  # per seed: the reference arm's final accuracy
    n = next(int(k.rsplit("_", 1)[1]) for k in finals[reference][0] if k.startswith("eval/avg_at_"))
    lines = [
        f"| arm | seeds | greedy base | greedy final | avg@{n} final | pass@{n} final | rollout length (last) "
        f"| first evaluated iteration at {reference}'s final accuracy of the same seed (median; per seed) "
        "| seconds per run (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, histories in arms.items():
        reach = [first_reaching(h, target) for h, target in zip(histories, targets, strict=True)]
        hit = [r for r in reach if r is not None]
        median = f"{statistics.median(hit):g}" if len(hit) == len(reach) else "not reached by every seed"
        per_seed = ", ".join(f"s{seed}: {'-' if r is None else r}" for seed, r in zip(seeds, reach, strict=True))
        lines.append(
            f"| {arm} | {len(histories)} | {spread([h.evals[0][GREEDY] for h in histories])} "
            f"| {spread([f[GREEDY] for f in finals[arm]])} "
            f"| {spread([f[f'eval/avg_at_{n}'] for f in finals[arm]])} "
            f"| {spread([f[f'eval/pass_at_{n}'] for f in finals[arm]])} "
            f"| {spread([h.iterations[h.last()][ROLLOUT_LENGTH] for h in histories])} "
            f"| {median}; {per_seed} "
            f"| {statistics.median(h.seconds[h.last()] for h in histories):.0f} |"
        )
    return "\n".join(lines)


TEACHER = "eval/teacher_accuracy"
TOPK_MASS = "sdpo/teacher_topk_mass_mean"


def diagnose(arms: dict[str, list[RunHistory]]) -> str:
    """What the self-teacher could teach, per arm (means over seeds): its greedy accuracy with the
    reference answer in context at each evaluation, and the share of its probability mass on the
    student's top-K ids (first and last iteration; 1.0 for the full-distribution divergence)."""
    steps = sorted({n for hs in arms.values() for h in hs for n in h.evals if TEACHER in h.evals[n]})
    lines = [
        "| arm | " + " | ".join(f"teacher accuracy @ {n}" for n in steps) + " | teacher top-K mass, first → last |",
        "|---" * (len(steps) + 2) + "|",
    ]
    for arm, histories in arms.items():
        cells = []
        for n in steps:
            values = [h.evals[n][TEACHER] for h in histories if TEACHER in h.evals.get(n, {})]
            cells.append(f"{statistics.mean(values):.3f}" if values else "-")
        mass = [
            (h.iterations[min(h.iterations)].get(TOPK_MASS), h.iterations[h.last()].get(TOPK_MASS)) for h in histories
        ]
        known = [(a, b) for a, b in mass if a is not None and b is not None]
        shown = (
            f"{statistics.mean(a for a, _ in known):.3f} → {statistics.mean(b for _, b in known):.3f}" if known else "-"
        )
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {shown} |")
    return "\n".join(lines)


TRAJECTORIES = (
    "rollout/response_length_mean",
    "teacher/entropy_mean",
    "srpo/routed_sdpo_share",
    "srpo/entropy_weight_p10",
    "sdpo/pass_rate_mean",
)


def trajectories(arms: dict[str, list[RunHistory]], keys: tuple[str, ...] = TRAJECTORIES) -> str:
    """Per arm, each iteration metric some arm logs, as its mean over the first and over the last
    quarter of the iterations (each a mean over seeds): where routing, entropy weights and answer
    lengths went during training."""
    logged = [k for k in keys if any(k in m for hs in arms.values() for h in hs for m in h.iterations.values())]
    if not logged:
        return ""
    lines = [
        "| arm | " + " | ".join(f"{k}, first → last quarter" for k in logged) + " |",
        "|---" * (len(logged) + 1) + "|",
    ]
    for arm, histories in arms.items():
        cells = []
        for key in logged:
            ends = []
            for h in histories:
                steps = sorted(n for n, m in h.iterations.items() if key in m)
                if steps:
                    q = max(1, len(steps) // 4)
                    ends.append(
                        tuple(statistics.mean(h.iterations[n][key] for n in part) for part in (steps[:q], steps[-q:]))
                    )
            cells.append(
                f"{statistics.mean(a for a, _ in ends):.3f} → {statistics.mean(b for _, b in ends):.3f}"
                if ends
                else "-"
            )
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_arm_plot(arms: dict[str, list[RunHistory]], path: Path) -> Path:
    """Per arm, the mean over seeds (line) and the range (band) of the student's greedy accuracy and
    of the self-teacher's accuracy with the answer in context, against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for arm, histories in arms.items():
        for ax, key in ((axes[0], GREEDY), (axes[1], TEACHER)):
            steps = sorted(set.intersection(*({n for n, m in h.evals.items() if key in m} for h in histories)))
            if not steps:
                continue
            values = [[h.evals[n][key] for h in histories] for n in steps]
            line = ax.plot(steps, [statistics.mean(v) for v in values], marker="o", label=arm)[0]
            ax.fill_between(
                steps, [min(v) for v in values], [max(v) for v in values], alpha=0.12, color=line.get_color()
            )
    for ax, title in (
        (axes[0], "student: held-out greedy accuracy"),
        (axes[1], "teacher: accuracy with the answer in context"),
    ):
        ax.set_xlabel("iteration")
        ax.set_title(f"{title} (mean over seeds, band: min-max)", fontsize=10)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--root", required=True, help="run root of the study's runs")
    parser.add_argument("--arm", action="append", required=True, help="NAME=OVERRIDE,OVERRIDE,... (repeatable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--reference", help="arm whose mean final accuracy the others must reach (default: last)")
    parser.add_argument("--plot", type=Path, default=Path("study.png"))
    parser.add_argument("--set", dest="common", action="append", default=[], help="OVERRIDE for every run (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (on a GPU: several small runs at once)")
    args = parser.parse_args()
    arms: dict[str, list[str]] = {}
    for spec in args.arm:
        name, _, overrides = spec.partition("=")
        arms[name] = [*args.common, *(o for o in overrides.split(",") if o)]
    # seed-major: an interrupted study has every arm at the same seeds
    plan = [(arm, overrides, seed) for seed in args.seeds for arm, overrides in arms.items()]
    if args.jobs == 1:
        for arm, overrides, seed in plan:
            run_arm(args.config, args.root, arm, overrides, seed, own_store=False)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_arm, args.config, args.root, *job, own_store=True) for job in plan]
            for future in futures:
                future.result()  # CalledProcessError names the run whose log to read
    histories = {arm: [read_history(args.root, f"{arm}-s{seed}") for seed in args.seeds] for arm in arms}
    table = summarise(histories, args.reference or list(arms)[-1], args.seeds) + "\n\n" + diagnose(histories)
    table += "\n\n" + trajectories(histories)
    print(table)
    plot = write_arm_plot(histories, args.plot)
    print(f"plot: {plot}")
    print(f"MLflow run: {log_study(args.root, args.config, arms, args.seeds, table, plot)}")


def log_study(root: str, config: Path, arms: dict[str, list[str]], seeds: list[int], table: str, plot: Path) -> str:
    """The study's table and plot as the artifacts of one MLflow run beside the study's runs."""
    import tempfile

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{Path(root).resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sdpo")
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("sdpo")
    run = client.create_run(experiment_id, run_name=f"study-{config.stem}", tags={"sdpo.study": str(config)})
    client.log_param(run.info.run_id, "seeds", " ".join(map(str, seeds)))
    for arm, overrides in arms.items():
        client.log_param(run.info.run_id, f"arm.{arm}", ",".join(overrides) or "(the config)")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "study.md").write_text(table + "\n")
        client.log_artifact(run.info.run_id, str(Path(folder) / "study.md"))
    client.log_artifact(run.info.run_id, str(plot))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


if __name__ == "__main__":
    main()
