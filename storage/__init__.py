"""Run storage: the only code that knows paths and formats (fsspec URLs, Parquet shards, manifests)."""

from storage.cache import download_checkpoint, pinned_cache
from storage.checkpoints import (
    LineageRecord,
    checkpoint_exists,
    checkpoint_iteration,
    format_lineage,
    lineage,
    read_checkpoint_manifest,
    resolve_checkpoint,
    upload_checkpoint,
)
from storage.errors import (
    AlreadyCommittedError,
    ChecksumMismatchError,
    ConfigMismatchError,
    LockHeldError,
    NotCommittedError,
    PreconditionFailedError,
    SchemaVersionError,
    ShardInvariantError,
    ShardJoinError,
    StorageError,
)
from storage.layout import RunLayout, config_hash, create_or_open_run, read_run, read_run_config
from storage.lock import LockHolder, RunLock, read_lock_holder
from storage.manifest import (
    Manifest,
    commit_iteration,
    iteration_committed,
    read_iteration_manifest,
    read_latest,
    read_stage_manifest,
    stage_done,
)
from storage.retry import RetryPolicy
from storage.schemas import ROLLOUT, TEACHER, ShardSchema
from storage.shard_columns import Ragged, ragged, topk
from storage.shard_reader import read_batches, read_stage_columns, read_table
from storage.shard_writer import ShardWriter, write_shards
from storage.stages import StageOutput, read_eval, read_stage_file, write_eval, write_stage_manifest

__all__ = [
    "ROLLOUT",
    "TEACHER",
    "AlreadyCommittedError",
    "ChecksumMismatchError",
    "ConfigMismatchError",
    "LineageRecord",
    "LockHeldError",
    "LockHolder",
    "Manifest",
    "NotCommittedError",
    "PreconditionFailedError",
    "Ragged",
    "RetryPolicy",
    "RunLayout",
    "RunLock",
    "SchemaVersionError",
    "ShardInvariantError",
    "ShardJoinError",
    "ShardSchema",
    "ShardWriter",
    "StageOutput",
    "StorageError",
    "checkpoint_exists",
    "checkpoint_iteration",
    "commit_iteration",
    "config_hash",
    "create_or_open_run",
    "download_checkpoint",
    "format_lineage",
    "iteration_committed",
    "lineage",
    "pinned_cache",
    "ragged",
    "read_batches",
    "read_checkpoint_manifest",
    "read_eval",
    "read_iteration_manifest",
    "read_latest",
    "read_lock_holder",
    "read_run",
    "read_run_config",
    "read_stage_columns",
    "read_stage_file",
    "read_stage_manifest",
    "read_table",
    "resolve_checkpoint",
    "stage_done",
    "topk",
    "upload_checkpoint",
    "write_eval",
    "write_shards",
    "write_stage_manifest",
]
