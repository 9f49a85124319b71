"""The sections that say where a run lives and runs, and what it keeps: storage and its retention,
tracking, and where each stage is launched. None of them changes what is trained."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.config.section import Section
from tasks.config.source import CREDENTIALS_GO
from tasks.config.urls import PlainUrl


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


class AllowListed(Section):
    """A mapping of storage options: a name that is not a field is refused, whatever its value, with
    where credentials go instead. Unset fields are left to s3fs, botocore and the environment."""

    @model_validator(mode="before")
    @classmethod
    def _allowed_names_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data:
                if name not in cls.model_fields:
                    shown = repr(str(name)[:40])
                    raise ValueError(
                        f"{shown} is not an allowed storage option (allowed here: {', '.join(cls.model_fields)}); "
                        + CREDENTIALS_GO
                    )
        return data


class S3Retries(AllowListed):
    """botocore's retries of one request."""

    max_attempts: int | None = Field(None, ge=0, le=50, description="attempts of one request")
    mode: Literal["legacy", "standard", "adaptive"] | None = Field(None, description="botocore's retry mode")


class S3Addressing(AllowListed):
    """How bucket names go into request URLs."""

    addressing_style: Literal["auto", "virtual", "path"] | None = Field(
        None, description="path for most S3-compatible servers (MinIO, Ceph)"
    )


class S3Client(AllowListed):
    """Arguments of the S3 client (s3fs `client_kwargs`)."""

    region_name: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]{0,62}$", description="e.g. eu-west-1")


class S3Config(AllowListed):
    """botocore `Config` (s3fs `config_kwargs`): timeouts, connections, retries, addressing."""

    connect_timeout: float | None = Field(None, gt=0, description="seconds to open a connection")
    read_timeout: float | None = Field(None, gt=0, description="seconds to wait for a response")
    max_pool_connections: int | None = Field(None, ge=1, description="connections kept open to the store")
    retries: S3Retries | None = None
    s3: S3Addressing | None = None


_ENDPOINT = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?/?$")


class StorageOptions(AllowListed):
    """The fsspec / s3fs options of the store: an allow-list of those that are not secrets. Credentials
    come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or a named
    profile of the AWS config files (`profile`), never from here. None of these is written to run.json,
    MLflow or a flow run's parameters: they say where the store is, not what the run computes."""

    endpoint_url: str | None = Field(None, description="scheme://host[:port] of an S3-compatible server")
    profile: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+=@-]{0,127}$",
        description="a named profile of ~/.aws/config and ~/.aws/credentials (AWS_CONFIG_FILE, "
        "AWS_SHARED_CREDENTIALS_FILE): the credentials stay there",
    )
    anon: bool | None = Field(None, description="unsigned requests (public buckets)")
    use_ssl: bool | None = Field(None, description="https to the endpoint (false for a plain-http local server)")
    requester_pays: bool | None = Field(None, description="requests to a requester-pays bucket")
    client_kwargs: S3Client | None = None
    config_kwargs: S3Config | None = None

    @field_validator("endpoint_url")
    @classmethod
    def _plain_endpoint(cls, url: str | None) -> str | None:
        if url is not None and not _ENDPOINT.match(url):  # the value is never shown: it may hold a token
            raise ValueError(
                "endpoint_url must be http(s)://host[:port] with no user, path, query or fragment; " + CREDENTIALS_GO
            )
        return url

    def as_fsspec(self) -> dict[str, Any]:
        """The options as fsspec takes them: only those set."""
        return self.model_dump(exclude_none=True)


class StorageConfig(Section):
    """Where runs live, how their files are checked and cached, and which checkpoints are kept."""

    root: str = Field("runs", description="run root: a local path, file://, s3:// or memory:// URL")
    storage_options: StorageOptions = Field(
        StorageOptions(), description="store options that are not secrets (StorageOptions); never recorded"
    )
    verify_sha256: bool = Field(
        True, description="hash every file read back from the store or the cache against its manifest"
    )
    cache_dir: str = Field(".sdpo/cache", description="local checkpoint cache, keyed by digest")
    logprob_dtype: Literal["float32", "float16"] = Field(
        "float32", description="precision of the top-K log-prob columns in the shards (float16: about 2/3 the bytes)"
    )
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

    @field_validator("root")
    @classmethod
    def _root_without_credentials(cls, root: str) -> str:
        if "://" in root:
            authority = root.split("://", 1)[1].split("/", 1)[0]
            if "@" in authority or "?" in root or "#" in root:  # the value is never shown: it may hold a token
                raise ValueError(
                    "a root URL names the bucket and prefix only (s3://bucket/prefix): no user, query or "
                    "fragment; " + CREDENTIALS_GO
                )
        return root


class TrackingConfig(Section):
    """MLflow: where runs are logged and what is logged besides the metrics."""

    uri: PlainUrl | None = Field(
        None,
        description="MLflow tracking URI (no user, query or fragment: a tracking server's credentials come from "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN); unset = one sqlite store per storage root: <root>/mlflow.db "
        "(local root) or .sdpo/mlflow.db (object-store root)",
    )
    experiment: str = Field("sdpo", description="the MLflow experiment the run is logged under")
    enabled: bool = Field(True, description="log to MLflow at all")
    ui_url: PlainUrl | None = Field(
        "http://127.0.0.1:5000",
        description="MLflow UI address the links of Prefect artifacts and `sdpo run` point at (its port is the one "
        "`sdpo run` prints `sdpo mlflow-ui` with); null = no Prefect links",
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
    overlap_commits: bool = Field(
        True,
        description="with in-process rollout, teacher and train stages, the embedded rollout engine and "
        "pipeline.max_staleness 0: the next "
        "iteration samples and scores from the trained weights in memory while this one's checkpoints are written "
        "and committed (the same bytes committed either way); false: each iteration starts once the previous one "
        "is committed",
    )

    @model_validator(mode="after")
    def _torchrun_stages(self) -> LaunchConfig:
        for stage in ("rollout", "eval"):
            if getattr(self, stage).launcher == "torchrun":
                raise ValueError(
                    f"launch.{stage}.launcher='torchrun': sampling scales out through SGLang servers behind the "
                    "router (rollout.engine=sglang), not torchrun; use inprocess or subprocess"
                )
        return self
