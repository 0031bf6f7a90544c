"""A bounded TCP transfer between two emulated hosts: the rate a shaped link really gives.

    python -m benchmarks.cluster.transfer recv ADDR PORT NBYTES TIMEOUT_S   # prints "ready", then the JSON
    python -m benchmarks.cluster.transfer send ADDR PORT NBYTES TIMEOUT_S

The receiver times the bytes from the first to the last, so connection set-up is not counted.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

CHUNK = 1 << 16


@dataclass(frozen=True)
class Transfer:
    nbytes: int
    seconds: float

    @property
    def bits_per_s(self) -> float:
        return self.nbytes * 8 / self.seconds


def _recv(addr: str, port: int, nbytes: int, timeout: float) -> None:
    with socket.create_server((addr, port)) as server:
        server.settimeout(timeout)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            got, first = 0, None
            while got < nbytes:
                data = conn.recv(CHUNK)
                if not data:
                    raise SystemExit(f"transfer: the sender closed after {got} of {nbytes} bytes")
                first = first or time.perf_counter()
                got += len(data)
            print(json.dumps({"nbytes": got, "seconds": time.perf_counter() - first}), flush=True)


def _send(addr: str, port: int, nbytes: int, timeout: float) -> None:
    with socket.create_connection((addr, port), timeout=timeout) as conn:
        block = bytes(CHUNK)
        left = nbytes
        while left > 0:
            conn.sendall(block[:min(left, CHUNK)])
            left -= CHUNK
        conn.shutdown(socket.SHUT_WR)


def measure(src_ns: str, dst_ns: str, dst_addr: str, nbytes: int, timeout: float = 30.0,
            port: int = 29600) -> Transfer:
    """Send ``nbytes`` from a process in ``src_ns`` to one listening on ``dst_addr`` in ``dst_ns``."""
    cmd = [sys.executable, "-m", "benchmarks.cluster.transfer"]
    args = [dst_addr, str(port), str(nbytes), str(timeout)]
    recv = subprocess.Popen(["ip", "netns", "exec", dst_ns, *cmd, "recv", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"transfer receiver in {dst_ns} did not start: {recv.stderr.read().strip()}")
        subprocess.run(["ip", "netns", "exec", src_ns, *cmd, "send", *args], check=True, timeout=timeout,
                       capture_output=True)
        out, err = recv.communicate(timeout=timeout)
        if recv.returncode != 0:
            raise RuntimeError(f"transfer receiver in {dst_ns} failed: {err.strip()}")
        result = json.loads(out)
        return Transfer(result["nbytes"], result["seconds"])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def main(argv: list[str]) -> None:
    if len(argv) != 5 or argv[0] not in ("recv", "send"):
        raise SystemExit(f"usage: python -m benchmarks.cluster.transfer recv|send ADDR PORT NBYTES TIMEOUT_S "
                         f"(got {argv})")
    role, addr, port, nbytes, timeout = argv
    (_recv if role == "recv" else _send)(addr, int(port), int(nbytes), float(timeout))


if __name__ == "__main__":
    main(sys.argv[1:])
