"""`python -m flows.cli ...` (how the process launchers start a stage)."""

from flows.cli import main

if __name__ == "__main__":  # a spawned worker process imports this module too (as __mp_main__)
    main()
