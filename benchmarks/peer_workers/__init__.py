"""Per-system torchrun workers of ``benchmarks.zero3_vs_peers`` and ``benchmarks.max_scale`` (one process per
rank, one system per job), and DeepSpeed's side of ``benchmarks.bench_ssd``."""
