"""Runtime: the engine, the executor, point-to-point transfers and microbatching."""
