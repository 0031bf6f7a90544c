"""Scripts run from a checkout (``python tools/NAME.py``), not installed: a package only so that the tests,
the benchmarks and ``python -m tools.NAME`` from the repository root can import them."""
