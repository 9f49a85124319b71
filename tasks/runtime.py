"""What every stage needs to start: the run's layout, its frozen config, local checkpoint copies.

Stages receive `(root, run, iteration)` and re-open the run from the store, so a stage can run in
any process or on any worker that reaches the store.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.cache import download_checkpoint
from storage.layout import RunLayout, read_run_config
from tasks.config import RunConfig, build_config, stored_tree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    layout: RunLayout
    cfg: RunConfig

    @property
    def url(self) -> str:
        return self.layout.run_url


def open_run(root: str, run: str) -> Run:
    """Open an existing run: its layout and the config frozen in run.json.

    Storage options come from those registered for `root` in this process
    (`storage.urls.register_options`) or from the standard environment; never from run.json.
    """
    layout = RunLayout(root, run)
    cfg = build_config(stored_tree(read_run_config(layout)))
    return Run(layout=layout, cfg=cfg)


def run_layout(cfg: RunConfig) -> RunLayout:
    """The layout of the run `cfg` describes, its storage options registered for this process."""
    from storage.urls import register_options

    register_options(cfg.storage.root, cfg.storage.storage_options.as_fsspec())
    return RunLayout(cfg.storage.root, cfg.name)


def start_run(cfg: RunConfig, layout: RunLayout, *, allow_config_change: bool = False) -> Run:
    """Create or open the run (refusing a changed config unless allowed, and LATEST unless it checks
    out against its iteration manifest), and sweep what crashed processes left behind (temporary
    files of the store and the cache). Call it holding the run lock. The returned run's config is
    the frozen one, with `cfg`'s placement (`launch`)."""
    from storage.adopt import adopt_latest
    from storage.layout import create_or_open_run
    from storage.scratch import sweep_local
    from tasks.config import to_dict

    create_or_open_run(layout, to_dict(cfg), allow_config_change=allow_config_change, resolve=as_read_now)
    adopt_latest(layout)
    sweep_local(cfg.storage.cache_dir, layout.local_dir)
    run = open_run(cfg.storage.root, cfg.name)
    # The frozen config says what the run computes; where its stages run is this process's choice.
    return Run(layout=run.layout, cfg=run.cfg.model_copy(update={"launch": cfg.launch}))


def check_config_unchanged(cfg: RunConfig, layout: RunLayout) -> None:
    """Raise ConfigMismatchError, with the old -> new differences, when the run exists under a
    config other than `cfg`: what `start_run` refuses without allow_config_change, found before a
    command starts Prefect or a flow."""
    from storage.layout import check_config_unchanged as check_stored
    from tasks.config import to_dict

    check_stored(layout, to_dict(cfg), resolve=as_read_now)


def as_read_now(stored: Mapping[str, Any]) -> Mapping[str, Any]:
    """A stored run config as this code reads it: validated, with the defaults of settings added
    since it was written filled in (a new setting's default keeps the behaviour it did not have).
    A stored config this code refuses is compared as stored, so every difference shows."""
    from tasks.config import ConfigError, to_dict

    try:
        return to_dict(build_config(stored_tree(dict(stored))))
    except ConfigError:
        return stored


def cache_bound_bytes(cfg: RunConfig) -> int | None:
    """`storage.cache_max_gb` in bytes (None: the local checkpoint cache is unbounded)."""
    max_gb = cfg.storage.cache_max_gb
    return None if max_gb is None else int(max_gb * 2**30)


def checkpoint_dir(run: Run, iteration: int, kind: str) -> Path:
    """A verified local copy of checkpoint `kind` ('policy' / 'teacher') written by `iteration`.

    Iteration 0 is the initial model. Pinned in the cache while the enclosing stage runs
    (`storage.cache.pinned_cache`).
    """
    return download_checkpoint(
        run.layout,
        f"iter-{iteration}",
        kind,
        cache_dir=run.cfg.storage.cache_dir,
        verify=run.cfg.storage.verify_sha256,
        max_cache_bytes=cache_bound_bytes(run.cfg),
    )


def behaviour_iteration(cfg: RunConfig, iteration: int) -> int:
    """The checkpoint iteration `iteration` samples from and whose teacher scores it: n-1 on policy,
    n-1-k with `pipeline.max_staleness` k (never before the initial model). Fixed by the config, so
    an iteration computes the same whether its stages ran ahead of the previous iteration's training
    or after it, in one process or after a restart."""
    return max(0, iteration - 1 - cfg.pipeline.max_staleness)


def ema_teacher_checkpoint(iteration: int) -> tuple[int, str]:
    """(iteration, kind) of the EMA teacher that scores `iteration`: the one the previous iteration
    wrote, or the initial policy for the first (the EMA teacher starts as the initial policy)."""
    return (0, "policy") if iteration == 1 else (iteration - 1, "teacher")


def teacher_checkpoint(run: Run, iteration: int) -> tuple[int, str]:
    """(iteration, kind) of the checkpoint whose weights score iteration `iteration`: the base model
    (static), the behaviour policy (live, trust-region) or the EMA teacher written with it (ema)."""
    mode = run.cfg.teacher.update
    basis = behaviour_iteration(run.cfg, iteration)
    if mode == "ema":
        return ema_teacher_checkpoint(basis + 1)
    if mode == "static":
        return 0, "policy"
    if mode in ("live", "trust-region"):
        return basis, "policy"
    raise ValueError(f"teacher.update={mode!r} is not a known update mode")


def _retention_rules(run: Run) -> dict[str, Any]:
    """The run's retention rules and staleness, and its evaluations by iteration, as `storage.retention` takes them."""
    from storage.retention import KeepRule
    from storage.stages import read_eval

    rules = run.cfg.storage.retention

    def eval_metric(n: int, name: str) -> float | None:
        metrics = read_eval(run.layout, n)
        return None if metrics is None or name not in metrics else float(metrics[name])

    return dict(
        staleness=run.cfg.pipeline.max_staleness,
        resumable=KeepRule(**rules.resumable.model_dump()),
        weights=KeepRule(**rules.weights.model_dump()),
        eval_metric=eval_metric,
    )


def apply_retention(run: Run, *, dry_run: bool = False) -> list[Any]:
    """Prune the checkpoints `storage.retention` does not keep, from a full pass (`sdpo gc`); the plan."""
    from storage.retention import apply

    return apply(run.layout, dry_run=dry_run, **_retention_rules(run))


def retain_after_commit(run: Run) -> list[Any]:
    """The flow's retention pass after each commit: it looks only at what can have changed since the
    previous pass (storage/retention.py); the prunes it made."""
    from storage.retention import apply_after_commit

    return apply_after_commit(run.layout, **_retention_rules(run))
