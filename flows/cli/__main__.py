"""`python -m flows.cli ...` (how the process launchers start a stage)."""

from flows.cli import main

main()
