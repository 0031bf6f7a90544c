"""Memory planner: does a GPT fit this hardware under zero_cache ZeRO-3, and with which configuration?

``sizes`` (the table of named GPT sizes) is standard library only: examples/start.sh reads it with the
system ``python3`` before the project's environment exists, so nothing here imports torch. ``stages``
builds each pipeline stage on the meta device (mixture-of-experts layers included), ``non_state`` estimates
the memory that is not model state, ``activations`` what the model keeps for its backward (sequence and context
parallelism, recompute, offload, the interleaved schedule), ``all_to_all`` the MoE layers' token exchange,
``plan`` places the states with the engine's own code and searches for the fastest configuration that fits,
``family`` finds the largest model of a family that fits, ``longest_seq`` the longest sequence, ``moe_args``
turns the MoE flags into the trainer's, ``cli`` is ``ptm-plan`` / ``python -m ptm_planner``.
"""
