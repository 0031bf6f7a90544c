"""Memory planner: does a GPT fit this hardware under zero_cache ZeRO-3, and with which configuration?

``sizes`` (the table of named GPT sizes) is standard library only: examples/start.sh reads it with the
system ``python3`` before the project's environment exists, so nothing here imports torch. ``stages``
builds each pipeline stage on the meta device, ``plan`` places its states with the engine's own code
and searches for the fastest configuration that fits, ``cli`` is ``ptm-plan`` / ``python -m ptm_planner``.
"""
