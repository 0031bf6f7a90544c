"""Multi-node launcher (``ptm-launch`` / ``python -m zero_cache.launcher``).

DeepSpeed-style hostfile and options on top of torchrun: one torchrun per host, started over ssh or
pdsh, ranks laid out in hostfile order. See the Multi-node section of README.md.
"""
