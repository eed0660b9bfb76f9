"""Benchmarks: every verb against the physical floor, a naive script and peer tools.

Run ``python -m benchmarks run --size 1GB,4GB``; see BENCHMARKS.md. This package
imports nothing heavy at import time: ``python -m benchmarks.floor`` must start as
fast as ``cp`` so that it stays a fair floor.
"""
