"""The trainer's checkpoints.

``manager``: what the training loop calls (save, resume, formats). ``checkpointer``: directories, the tracker,
background saves, cleanup. ``layout``: where this rank's parameters lie in the global tensors. ``ddp_states``:
the plain data-parallel backend behind zero_cache's checkpoint interface (the engine implements it itself).
``legacy``: Megatron's per-rank ``mp_rank_*`` layout. ``rng``: RNG states and plain values. ``config``: flags.
"""
