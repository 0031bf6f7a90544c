"""Environment sent to every node: selected variables of the launching shell plus ``.ptm_env`` lines.

ssh starts remote commands with a bare environment, so the launcher re-exports what distributed
jobs need (the DeepSpeed runner does the same with its prefix list and ``.deepspeed_env``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

ENV_FILE_NAME = ".ptm_env"
ENV_FILE_VAR = "PTM_ENV_FILE"
# Prefixes of variables copied from the launching shell to every node.
FORWARD_PREFIXES = ("PYTHON", "NCCL_", "GLOO_", "TP_SOCKET_IFNAME", "TORCH_", "OMP_", "MKL_", "UCX_", "FI_",
                    "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "HF_", "TOKENIZERS_PARALLELISM")
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvFileError(ValueError):
    """A .ptm_env file line that is not KEY=VALUE."""


def forwarded_environ(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in sorted(environ.items())
            if key.startswith(FORWARD_PREFIXES) and _KEY_RE.fullmatch(key)}


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` per line; blank lines and ``#`` comments skipped; optional ``export``; one pair of
    surrounding quotes removed. Values are taken literally (no shell expansion)."""
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY_RE.fullmatch(key):
            raise EnvFileError(f"{source} line {lineno}: expected KEY=VALUE with a shell variable name as KEY, "
                               f"got {raw.strip()!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def env_files(environ: Mapping[str, str], cwd: Path, home: Path) -> list[Path]:
    """$PTM_ENV_FILE if set (it must exist); else ~/.ptm_env then ./.ptm_env (later files win)."""
    if environ.get(ENV_FILE_VAR):
        path = Path(environ[ENV_FILE_VAR])
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise EnvFileError(f"{ENV_FILE_VAR}={path} {what}; point it at a KEY=VALUE file or unset it")
        return [path]
    candidates = [home / ENV_FILE_NAME, cwd / ENV_FILE_NAME]
    unique = [p for i, p in enumerate(candidates) if p.is_file() and p.resolve() not in
              {q.resolve() for q in candidates[:i]}]
    return unique


def env_file_values(environ: Mapping[str, str], cwd: Path, home: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for path in env_files(environ, cwd, home):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else f"not UTF-8 text: {e.reason} at byte {e.start}"
            raise EnvFileError(f"{path}: cannot be read ({reason}); make it a UTF-8 file of KEY=VALUE lines, or "
                               f"remove it") from None
        values.update(parse_env_file(text, str(path)))
    return values
