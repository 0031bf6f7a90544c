"""Command line -> typed configuration: the only code that knows argparse.

One module per flag group (Megatron-LM's flag names), each with ``add_<group>_args(parser)`` and
``<group>_config_from_args(args)``; ``parse_args`` (parse.py) composes them into one frozen ``Config``.
The tokenizer and data groups need no torch, so tools that only use them (tools/preprocess_data.py and
its spawned workers) stay light: ``parse_args`` and the rest load on first use.
"""
from importlib import import_module

_LAZY = {
    "parse_args": "megatron.training.arguments.parse",
    "build_parser": "megatron.training.arguments.parse",
    "ConfigError": "megatron.training.config",
}

__all__ = [*_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron.training.arguments' has no attribute {name!r}")
