"""Benchmarks, run from the repository root as modules: ``python -m benchmarks.zero3_vs_peers`` etc.

What each one measures, how to run it and its output columns: ``benchmarks/README.md``. Printed tables and
plots go to ``benchmarks/results/``; raw logs and per-attempt files to ``benchmarks/logs/`` (not in git).
"""
