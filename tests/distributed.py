"""Spawn gloo worker processes for executor-level tests, with a hard timeout (a hang fails)."""

from lightning_pipe.runtime.spawn import free_port
from lightning_pipe.runtime.spawn import run_gloo as run_workers

__all__ = ["free_port", "run_workers"]
