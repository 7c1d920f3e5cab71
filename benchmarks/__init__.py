"""Benchmarks: each script measures side by side in one run and writes its results page under docs/results/."""
