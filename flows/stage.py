"""One stage as its own flow run, for Prefect work pools: deploy `sdpo_stage` on a pool (e.g.
rollout on an inference pool, train on a GPU pool) and the `work-pool` launcher runs each stage
there (`launch.<stage>.launcher: work-pool`, `launch.<stage>.deployment: sdpo-stage/<name>`).

Placement is the pool's, not ours: the worker starts the flow run wherever its infrastructure
runs jobs (a process, a Kubernetes pod, ...), and the stage reads and writes the store only.
"""

from __future__ import annotations

from prefect import flow


@flow(name="sdpo-stage", log_prints=False)
def sdpo_stage(stage: str, root: str, run: str, iteration: int) -> None:
    """Run stage `stage` of iteration `iteration` of run `run` under `root` in this flow run's process.

    The store's options come from the environment of the pool's jobs (`SDPO_STORAGE_OPTIONS`, set in
    the work pool's or deployment's job variables), never from the flow run's parameters."""
    from flows.orchestration import quiet_libraries
    from tasks.launch import register_stage_options, run_stage

    quiet_libraries()
    register_stage_options(root)
    run_stage(stage, root, run, iteration)
