"""`sdpo view`: a read-only browser (and terminal viewer) for a run's rollouts and the teacher's
per-token credit.

- `data`: the iteration index (one pass over the light columns of a stage), sorting, filters, paging.
- `samples`: one sample and one group, decoded with the policy's tokenizer.
- `render`: what both front ends share: `<think>` / tool-call / code regions, the credit colour scale.
- `app`: the FastAPI app serving `static/index.html` and the JSON API; `tui`: the Textual app.
"""


def view_command(run_name: str, root: str) -> str:
    """The shell command that opens the viewer on a run (for the MLflow run tag)."""
    import shlex

    return f"sdpo view {shlex.quote(run_name)} --root {shlex.quote(root)}"
