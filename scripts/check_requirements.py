"""After pip could not install the pins (no package index, as on an offline GPU machine): is what is installed enough?

    python scripts/check_requirements.py --log PIP_LOG requirements.txt [requirements-dev.txt]

Run by scripts/bootstrap.sh with the venv's python. Prints one line to stderr. Exit 0 when every required pin
is installed, at its version or another (the machine's own packages are used as they are); exit 1 naming the
missing ones otherwise. A pin whose line ends in ``# optional: <what needs it>`` may be missing.
Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from importlib import metadata

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+))?")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str | None  # None: any version
    optional: str | None  # what needs it, when it may be missing

    def __str__(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


def read_pins(path: str) -> list[Pin]:
    pins = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line, _, comment = raw.partition("#")
            match = _PIN.match(line.strip())
            if not match:
                continue  # blank, a comment, or a pip option line
            note = comment.strip()
            optional = (note.split(":", 1)[1].strip() or "optional") if note.startswith("optional:") else None
            pins.append(Pin(match.group(1), match.group(2), optional))
    return pins


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def verdict(pins: list[Pin], log: str) -> tuple[bool, str]:
    """(enough to go on, the one line to print)."""
    missing, optional_missing, differing = [], [], []
    for pin in pins:
        have = installed_version(pin.name)
        if have is None:
            (optional_missing if pin.optional else missing).append(pin)
        elif pin.version and have != pin.version:
            differing.append(f"{pin.name} {have} (pinned {pin.version})")
    if missing:
        names = ", ".join(map(str, missing))
        return False, (f"[bootstrap] error: {names} not installed and pip could not install "
                       f"{'it' if len(missing) == 1 else 'them'} (no package index reachable? pip's output: {log}); "
                       f"install {'it' if len(missing) == 1 else 'them'}, or give pip an index (PIP_INDEX_URL) or "
                       f"wheels (PIP_FIND_LINKS)")
    parts = []
    if differing:
        parts.append("at other versions than pinned: " + ", ".join(differing))
    if optional_missing:
        parts.append("not installed (optional): " + ", ".join(f"{p} ({p.optional})" for p in optional_missing))
    found = "; ".join(parts) or "every pin is installed"
    return True, (f"[bootstrap] pip could not install the pins (no package index reachable? pip's output: {log}); "
                  f"going on with what is installed: {found}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", required=True, help="pip's output, named in the line")
    parser.add_argument("requirements", nargs="+", help="pinned requirement files")
    args = parser.parse_args(argv)
    ok, line = verdict([pin for path in args.requirements for pin in read_pins(path)], args.log)
    print(line, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
