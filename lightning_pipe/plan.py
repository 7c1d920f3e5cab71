"""``python -m lightning_pipe.plan``: the planner's command line (:mod:`lightning_pipe.lightning.plan_cli`)."""

from lightning_pipe.lightning.plan_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
