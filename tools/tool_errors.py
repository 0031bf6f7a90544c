"""One line and exit status 2 for a tool's bad input instead of a traceback (the trainer's convention,
megatron/training/errors.py): a missing or unreadable file, a path under a file, malformed content.

    with one_line_errors("zero_to_fp32.py", "give the --save directory of a pretrain_gpt.py run", CheckpointError):
        ...

A third-party package that is not installed is one line naming it and the fix too. Exceptions of other types are
bugs and keep their traceback. Standard library only: the tools that need no torch import it too.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Iterator, NoReturn

EXIT_BAD_INPUT = 2
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail(prog: str, message: str) -> NoReturn:
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())  # torch's are several
    print(f"{prog}: error: {one_line}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def describe(exc: BaseException) -> str:
    """The problem and the file it concerns, in a few words."""
    if isinstance(exc, OSError) and exc.filename is not None:
        if isinstance(exc, (FileExistsError, NotADirectoryError)):  # a directory was wanted where a file is
            return f"{exc.filename}: a file is in the way of a directory ({exc.strerror})"
        second = f" -> {exc.filename2}" if exc.filename2 is not None else ""
        return f"{exc.filename}{second}: {exc.strerror or exc}"
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    text = str(exc)
    return text[1:-1] if isinstance(exc, KeyError) and text.startswith("'") else text


@contextlib.contextmanager
def one_line_errors(prog: str, fix: str, *more: type[BaseException]) -> Iterator[None]:
    """Turn OSError, ValueError and ``more`` into ``prog: error: <problem>``, exit status 2. The tools' own
    errors name their fix; a file that cannot be read or written, or text that does not decode, gets ``fix``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if not top or os.path.exists(os.path.join(REPOSITORY, top)):
            raise  # a module of this repository that is missing is a bug
        fail(prog, f"the Python package '{top}' is not installed; install the requirements: "
                   f"pip install -r {os.path.join(REPOSITORY, 'requirements.txt')}")
    except (OSError, ValueError, *more) as exc:
        # The OS's own errors carry the file name; a tool's own FileNotFoundError says its fix already.
        bare = isinstance(exc, (UnicodeDecodeError, json.JSONDecodeError)) or \
            isinstance(exc, OSError) and exc.filename is not None
        fail(prog, f"{describe(exc)}; {fix}" if bare else describe(exc))
