"""Per-system torchrun workers of benchmarks/zero3_vs_peers.py (one process per rank, one system per job)."""
