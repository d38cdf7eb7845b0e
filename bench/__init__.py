"""Benchmarks: `make bench` (python -m bench). Results in bench/results/ (CSV, REPORT.md, PNG)."""
