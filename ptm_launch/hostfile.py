"""Hostfiles (``hostname slots=N`` lines) and the DeepSpeed-style host/slot selection on top of them.

A *resource pool* maps each host, in hostfile order, to its slot count. A *selection* maps each
chosen host to the list of slot (device) indices used on it; ranks are laid out in that order.
"""
from __future__ import annotations

import re
from pathlib import Path

# Host names travel to ssh/pdsh argv and into messages: a conservative charset that cannot carry
# shell syntax or be read as an option (no leading '-').
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_LINE_RE = re.compile(r"(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)")


class HostfileError(ValueError):
    """A hostfile or an --include/--exclude/--num_nodes/--num_gpus selection that cannot be used."""


def check_host_name(name: str, where: str) -> str:
    if not _HOST_RE.fullmatch(name):
        raise HostfileError(f"{where}: {name!r} is not a valid host name (use letters, digits, '.', '-', '_'; "
                            f"it must start with a letter or digit)")
    return name


def parse_hostfile_text(text: str, source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile text into an ordered {host: slots} pool; every problem names its line."""
    pool: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        match = _LINE_RE.fullmatch(line)
        if match is None:
            raise HostfileError(f"{where}: malformed line {raw.strip()!r}; expected 'hostname slots=N'")
        host = check_host_name(match["host"], where)
        try:
            slots = int(match["slots"])
        except ValueError:
            slots = 0
        if slots <= 0:
            raise HostfileError(f"{where}: slots must be a positive integer, got {match['slots']!r}")
        if host in pool:
            raise HostfileError(f"{where}: duplicate host {host!r}; list each host once with its total slots")
        pool[host] = slots
    if not pool:
        raise HostfileError(f"{source}: no hosts found; add lines like 'worker-1 slots=8'")
    return pool


def read_hostfile(path: str | Path) -> dict[str, int]:
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise HostfileError(f"hostfile {str(path)!r} {what}; pass an existing file to --hostfile, "
                            f"or leave --hostfile out to run on this machine only")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HostfileError(f"hostfile {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); write it "
                            f"as lines like 'worker-1 slots=8'") from None
    return parse_hostfile_text(text, source=str(path))


def parse_filter(spec: str, pool: dict[str, int], flag: str) -> dict[str, list[int] | None]:
    """Parse ``host1@host2:0,2`` into {host: slots or None (= whole host)}, checked against the pool."""
    chosen: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slot_text = part.strip().partition(":")
        if not host:
            raise HostfileError(f"{flag} {spec!r}: empty host entry; use 'host1@host2:0,2'")
        check_host_name(host, f"{flag} {spec!r}")
        if host not in pool:
            raise HostfileError(f"{flag} names host {host!r}, which is not in the hostfile "
                                f"(hosts: {', '.join(pool)})")
        if not sep:
            chosen[host] = None
            continue
        try:
            slots = [int(s) for s in slot_text.split(",")]
        except ValueError:
            raise HostfileError(f"{flag} {spec!r}: slots of {host!r} must be comma-separated integers, "
                                f"got {slot_text!r}") from None
        bad = [s for s in slots if not 0 <= s < pool[host]]
        if bad:
            raise HostfileError(f"{flag} asks for slot(s) {bad} of host {host!r}, which has slots "
                                f"0..{pool[host] - 1} (slots={pool[host]} in the hostfile)")
        previous = chosen.get(host, [])
        chosen[host] = sorted(set((previous or []) + slots))
    return chosen


def select_resources(pool: dict[str, int], include: str = "", exclude: str = "",
                     num_nodes: int = -1, num_gpus: int = -1) -> dict[str, list[int]]:
    """Apply --include or --exclude, then --num_nodes (first N hosts), then --num_gpus (first N slots)."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; use one of them")
    selection = {host: list(range(slots)) for host, slots in pool.items()}
    if include:
        wanted = parse_filter(include, pool, "--include")
        selection = {host: selection[host] if wanted[host] is None else wanted[host]
                     for host in selection if host in wanted}
    elif exclude:
        dropped = parse_filter(exclude, pool, "--exclude")
        for host, slots in dropped.items():
            selection[host] = [] if slots is None else [s for s in selection[host] if s not in slots]
        selection = {host: slots for host, slots in selection.items() if slots}
    if not selection:
        raise HostfileError("no slots left after --include/--exclude; check the filter against the hostfile")
    if num_nodes > 0:
        if num_nodes > len(selection):
            raise HostfileError(f"--num_nodes {num_nodes} but only {len(selection)} host(s) are selected "
                                f"({', '.join(selection)})")
        selection = dict(list(selection.items())[:num_nodes])
    if num_gpus > 0:
        short = {host: len(slots) for host, slots in selection.items() if len(slots) < num_gpus}
        if short:
            raise HostfileError(f"--num_gpus {num_gpus} but these hosts have fewer selected slots: {short}")
        selection = {host: slots[:num_gpus] for host, slots in selection.items()}
    return selection
