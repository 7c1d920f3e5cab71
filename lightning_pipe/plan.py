"""``python -m lightning_pipe.plan``: the planner's command line (:mod:`lightning_pipe.planning.cli`)."""

from lightning_pipe.planning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
