"""Benchmark suite of simpler-daemon: the workloads of PERFORMANCE.md, engine and peers side by side.

Run ``python -m benchmarks --help``; see ``benchmarks/README.md``.
"""
