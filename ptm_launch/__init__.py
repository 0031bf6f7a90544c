"""Multi-node launcher (``ptm-launch`` / ``python -m ptm_launch``).

DeepSpeed-style hostfile and options on top of torchrun: one torchrun per host, started over ssh or
pdsh, ranks laid out in hostfile order (docs/multinode.md). It only starts and
stops processes, so it imports nothing from the engine or the trainer.
"""
