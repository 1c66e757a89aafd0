"""Benchmark suite of simpler-daemon: engine and peers side by side on the same workloads.

Run ``python -m benchmarks --help``; see ``benchmarks/README.md``.
"""
