"""Catacloud benchmarks: `make bench` (python -m benchmarks), see BENCHMARKS.md."""
