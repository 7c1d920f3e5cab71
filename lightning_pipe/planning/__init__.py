"""Planning: block profiles, cost and memory models, prediction, MadPipe partitioning, the layout search and its CLI."""
