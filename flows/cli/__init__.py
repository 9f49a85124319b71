"""The `sdpo` command line (`flows.cli:app`): the app and its shared options in `app`, the commands
that run in `runs`, the ones that inspect and maintain runs in `audit`, the one that resumes a deployment's schedules in
`schedules`, the one that opens the MLflow UI in `tracking`."""

# importing the command modules registers their commands on `app`, in this order in `sdpo --help`
# isort: off
from flows.cli import runs  # noqa: F401
from flows.cli import audit  # noqa: F401
from flows.cli import schedules  # noqa: F401
from flows.cli import tracking  # noqa: F401

# isort: on
from flows.cli.app import app


def main() -> None:
    from tasks.allocator import keep_freed_heap
    from tasks.lifetime import end_on_termination
    from tasks.preload import freeze_for_exit

    end_on_termination()  # `kill` ends a command through its cleanup, as Ctrl-C does
    keep_freed_heap()  # before any tensor work of this process (a stage process starts here too)
    try:
        app()
    finally:
        freeze_for_exit()  # the interpreter's collections at exit skip what the command built


__all__ = ["app", "main"]
