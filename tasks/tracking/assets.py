"""What an MLflow run holds beyond metrics: its data sets as dataset inputs, its policies as models.

- The training prompts and the held-out prompts are logged once per MLflow run as dataset inputs
  (contexts `training` and `evaluation`): their digest tells two runs on the same data apart from
  two runs on different data, in the MLflow UI's dataset column.
- When a run completes, its final policy (and, when an evaluation found a better one, the best
  policy by `eval/greedy_accuracy`) is logged as an MLflow `transformers` model: `policy`, and
  `best_policy`; with `tracking.register_model: NAME` the final policy is also registered under
  NAME, a new version per run. Both read the committed checkpoints from the store. Each model
  carries the metrics of the iteration that produced it (its evaluation among them), which the
  MLflow UI shows beside the model.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

DATASETS_TAG = "sdpo.datasets_logged"
POLICIES_TAG = "sdpo.policies_logged"
BEST_METRIC = "eval/greedy_accuracy"


def _frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(
        {
            "prompt_id": [str(r["prompt_id"]) for r in rows],
            "prompt": [r["prompt_messages"][-1]["content"] for r in rows],
            "label": [str(r["label"]) for r in rows],
            "data_source": [str(r["data_source"]) for r in rows],
        }
    )


def log_datasets(tracker: Any, run: Any) -> None:
    """The run's training and evaluation prompts as MLflow dataset inputs (once per MLflow run)."""
    import mlflow
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from tasks.data.prompts import load_splits, training_rows

    if not tracker.enabled or tracker.client.get_run(tracker.run_id).data.tags.get(DATASETS_TAG) == "1":
        return
    cfg = run.cfg
    _, eval_rows = load_splits(cfg.data, seed=cfg.seed)
    train_rows = training_rows(cfg.data, seed=cfg.seed)
    inputs = []
    for context, rows in (("training", train_rows), ("evaluation", eval_rows[: cfg.data.eval_prompts])):
        # no MLflow source: a generated task has no file; where the rows come from is the tag below
        dataset = mlflow.data.from_pandas(_frame(rows), name=f"{cfg.name}-{context}")
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    tracker.client.log_inputs(tracker.run_id, datasets=inputs)
    origin = cfg.data.path or f"{cfg.data.source} (seed {cfg.seed})"
    tracker.set_tags({DATASETS_TAG: "1", "sdpo.data_origin": str(origin)})


def _best_iteration(run: Any) -> int | None:
    from storage.stages import read_eval

    scored = [
        (float(metrics[BEST_METRIC]), n)
        for n in range(1, run.cfg.iterations + 1)
        if (metrics := read_eval(run.layout, n)) is not None and BEST_METRIC in metrics
    ]
    return max(scored)[1] if scored else None


def _log_policy(tracker: Any, run: Any, iteration: int, name: str, *, registered_name: str | None) -> None:
    import mlflow
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storage.cache import pinned_cache
    from storage.credentials import check_record
    from tasks.runtime import checkpoint_dir

    with pinned_cache():
        folder = checkpoint_dir(run, iteration, "policy")
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    metadata = {"sdpo.run_url": run.layout.run_url, "sdpo.iteration": iteration}
    check_record({"name": registered_name, "metadata": metadata}, record=f"MLflow model {name}")
    mlflow.set_tracking_uri(tracker.uri)
    with mlflow.start_run(run_id=tracker.run_id):
        mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer},
            name=name,
            task="text-generation",
            # pinned here: MLflow's inference of the requirements imports optional packages (torchvision)
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"],
            registered_model_name=registered_name,
            metadata=metadata,
            step=iteration,  # the model's metrics: the run's at the step (iteration) that produced it
        )
    logger.info("logged the policy of iteration %d as MLflow model %r", iteration, name)


def log_policies(tracker: Any, run: Any) -> None:
    """The final policy (and the best one, when it is another) as MLflow models, once per run."""
    from storage.retention import is_pruned

    cfg = run.cfg
    if not (tracker.enabled and cfg.tracking.log_model):
        return
    if tracker.client.get_run(tracker.run_id).data.tags.get(POLICIES_TAG) == str(cfg.iterations):
        return
    _log_policy(tracker, run, cfg.iterations, "policy", registered_name=cfg.tracking.register_model)
    best = _best_iteration(run)
    if best is not None and best != cfg.iterations:
        if is_pruned(run.layout, best, "policy"):
            logger.warning(
                "the best policy (iteration %d by %s) was pruned by retention; not logged", best, BEST_METRIC
            )
        else:
            _log_policy(tracker, run, best, "best_policy", registered_name=None)
    tracker.set_tags({POLICIES_TAG: str(cfg.iterations)})
