"""The sections that say where a run lives and runs, and what it keeps: storage and its retention,
tracking, and where each stage is launched. None of them changes what is trained."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tasks.config.section import Section


class KeepRuleConfig(Section):
    """Keep a checkpoint when any clause holds; no clause at all keeps every checkpoint."""

    last: int | None = Field(None, ge=1, description="the last N iterations")
    every: int | None = Field(None, ge=1, description="every M-th iteration")
    best: str | None = Field(
        None, description="the iteration with the highest value of this eval metric, e.g. eval/greedy_accuracy"
    )


class RetentionConfig(Section):
    """Which checkpoints keep their files after each commit (`sdpo gc RUN --dry-run` shows the plan).
    What a resume or the next iteration reads is always kept (storage/retention.py)."""

    resumable: KeepRuleConfig = Field(
        KeepRuleConfig(), description="full training state (weights, Adam, schedule: ~16 bytes per parameter)"
    )
    weights: KeepRuleConfig = Field(KeepRuleConfig(), description="HF policy and teacher weights")


class StorageConfig(Section):
    root: str = Field("runs", description="run root: a local path, file://, s3:// or memory:// URL")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options (e.g. endpoint_url); secrets stay out of logs"
    )
    verify_sha256: bool = True
    cache_dir: str = Field(".sdpo/cache", description="local checkpoint cache, keyed by digest")
    logprob_dtype: Literal["float32", "float16"] = "float32"
    lock_lease_seconds: int = Field(
        3600, ge=10, description="a run lock older than this (and not renewed) may be taken over"
    )
    retention: RetentionConfig = RetentionConfig()
    cache_max_gb: float | None = Field(
        None, gt=0, description="bound the local checkpoint cache: least recently used checkpoints are evicted"
    )
    link_uploads: bool = Field(
        True,
        description="a local (file://) root on the cache's file system takes the checkpoints the train stage "
        "wrote as hard links, not copies: one copy of the bytes on that disk, shared with the cache; false "
        "keeps two copies",
    )


class TrackingConfig(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; unset = one sqlite store per storage root: <root>/mlflow.db "
        "(local root) or .sdpo/mlflow.db (object-store root)",
    )
    experiment: str = "sdpo"
    enabled: bool = True
    ui_url: str | None = Field(
        "http://127.0.0.1:5000", description="MLflow UI address that Prefect artifacts link to; null = no links"
    )
    system_metrics: bool = Field(
        True, description="sample CPU, memory, disk and GPU use into the MLflow run (system/*)"
    )
    log_model: bool = Field(
        True, description="log the final (and best) policy as an MLflow transformers model when the run completes"
    )
    register_model: str | None = Field(None, description="also register the final policy under this model name")


class StageLaunch(Section):
    """How one stage's process is started; placement only, never a change to what it computes."""

    launcher: Literal["inprocess", "subprocess", "torchrun", "work-pool"] = Field(
        "inprocess",
        description="inprocess: inside the flow's process; subprocess: a fresh `sdpo stage` process (its "
        "crash cannot take the flow down); torchrun: `sdpo stage` under torchrun over nproc_per_node x nnodes "
        "ranks; work-pool: its own flow run of the `deployment`, on that deployment's Prefect work pool",
    )
    deployment: str | None = Field(
        None, description="work-pool: the deployment of flows/stage.py:sdpo_stage to run, e.g. sdpo-stage/gpu"
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="subprocess / torchrun: kill the stage's process group after this many seconds; "
        "work-pool: stop waiting for its flow run. The stage fails and its next attempt resumes from the store",
    )
    nproc_per_node: int = Field(1, ge=1, description="torchrun: processes on this node")
    nnodes: int = Field(1, ge=1, description="torchrun: nodes taking part (each runs the same flow step)")
    node_rank: int = Field(0, ge=0, description="torchrun: this node's rank among nnodes")
    rdzv_endpoint: str | None = Field(
        None, description="torchrun with nnodes > 1: host:port of the rendezvous (c10d), reachable from every node"
    )
    master_port: int | None = Field(
        None, ge=1, le=65535, description="torchrun on one node: fixed port (default: a free one)"
    )

    @model_validator(mode="after")
    def _torchrun_fields(self) -> StageLaunch:
        if self.launcher != "torchrun" and (self.nproc_per_node, self.nnodes) != (1, 1):
            raise ValueError(f"nproc_per_node/nnodes need launcher='torchrun', not {self.launcher!r}")
        if (self.launcher == "work-pool") != (self.deployment is not None):
            raise ValueError("launcher='work-pool' and deployment (e.g. sdpo-stage/gpu) go together")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint (host:port reachable from every node)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        return self


class LaunchConfig(Section):
    """Where each stage runs. Not part of the run's frozen config: a run can move between machines
    and launchers and resume, since every stage reads its inputs from the store and writes its outputs there."""

    rollout: StageLaunch = StageLaunch()
    teacher: StageLaunch = StageLaunch()
    train: StageLaunch = StageLaunch()
    eval: StageLaunch = StageLaunch()

    @model_validator(mode="after")
    def _torchrun_stages(self) -> LaunchConfig:
        for stage in ("rollout", "eval"):
            if getattr(self, stage).launcher == "torchrun":
                raise ValueError(
                    f"launch.{stage}.launcher='torchrun': sampling scales out through SGLang servers behind the "
                    "router (rollout.engine=sglang), not torchrun; use inprocess or subprocess"
                )
        return self
