"""The data-set formats `prepare` reads: one module per data set, each with `convert(record, index,
options)` -> a prompt-data row, or None to leave the record out. `DATASETS` registers them with the
keyword options each accepts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.data.formats import (
    arc,
    bfcl,
    gsm8k,
    humaneval,
    livecodebench,
    mbpp,
    mmlu,
    reasoning_gym,
    sciknoweval,
    sciq,
    toolalpaca,
    tooluse,
)
from tasks.data.rows import Row


@dataclass(frozen=True)
class Dataset:
    convert: Callable[[Any, int, dict], Row | None]
    options: frozenset[str] = frozenset()


DATASETS: dict[str, Dataset] = {
    "sciknoweval": Dataset(sciknoweval.convert, frozenset({"domain", "domains", "levels", "types"})),
    "tooluse": Dataset(tooluse.convert),
    "toolalpaca": Dataset(toolalpaca.convert),
    "livecodebench": Dataset(
        livecodebench.convert, frozenset({"include_public", "test_seed", "train_test_fraction", "time_limit"})
    ),
    "humaneval": Dataset(humaneval.convert, frozenset({"time_limit"})),
    "mbpp": Dataset(mbpp.convert, frozenset({"time_limit"})),
    "gsm8k": Dataset(gsm8k.convert),
    "arc": Dataset(arc.convert),
    "mmlu": Dataset(mmlu.convert, frozenset({"subject"})),
    "sciq": Dataset(sciq.convert),
    "bfcl": Dataset(bfcl.convert, frozenset({"answers", "no_call"})),
    "reasoning_gym": Dataset(reasoning_gym.convert, frozenset({"size"})),
}
"""Data set name -> converter; `options` are the dataset-specific keyword options `prepare` accepts."""
