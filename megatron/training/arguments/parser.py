"""The trainer's ``ArgumentParser``: bad command lines are one ``ConfigError`` line, ``--help`` shows defaults.

argparse's own way (usage dump, ``SystemExit(2)`` from inside ``parse_args``) would print on every rank of a
torchrun job and bury the cause; raising ``ConfigError`` lets ``errors.run_trainer`` print one line on one rank
and exit 2 on all of them. An unknown flag names the closest known one (difflib), as a typo usually is.
"""
from __future__ import annotations

import argparse
import copy
import difflib
from typing import NoReturn

from megatron.training.config import ConfigError

_HELP_HINT = "pretrain_gpt.py --help lists every flag"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` on every flag, also those without help text (argparse shows none for them)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings:
            action = copy.copy(action)
            action.help = "(required)" if action.required else "(default: %(default)s)"
        return super()._format_action(action)


class TrainerArgumentParser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        super().__init__(formatter_class=HelpFormatter, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Missing, malformed or out-of-choice values (argparse's message names the flag)."""
        raise ConfigError(f"{message} ({_HELP_HINT})")

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ConfigError(self._unknown(unknown))
        return parsed

    def _unknown(self, unknown: list[str]) -> str:
        flag = next((u for u in unknown if u.startswith("-")), None)
        if flag is None:  # a value argparse could not attach to any flag
            return (f"unexpected argument {unknown[0]!r}: a value without its flag, or a flag that takes fewer "
                    f"values; check the command line ({_HELP_HINT})")
        name = flag.split("=", 1)[0]
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else _HELP_HINT
        return (f"unknown flag {name}; {hint} (docs/megatron-compat.md lists the Megatron-LM and "
                f"Megatron-DeepSpeed flags this trainer takes)")
