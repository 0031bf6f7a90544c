"""benchmarks/gpu_check.sh --rehearse: the GPU check's own stages, jobs and record on CPU + gloo with tiny models,
here its cheap stages (set-up, the matmul peak and the machine, the largest model on GPU + host + SSD tiers). Every
stage ends inside its cap and every row of the summary has figures; the training job rendezvouses although this
host's name resolves nowhere (as on a GPU machine without network whose hostname is not in /etc/hosts), and the
engine's own report puts states on the SSD tier. The whole rehearsal (all six stages) is in docs/gpu.md."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]

# Imported by every python the check starts (PYTHONPATH): this host's name is one that does not resolve.
UNRESOLVABLE_HOST = '''import socket
socket.gethostname = lambda: "no-such-host.invalid"
socket.getfqdn = lambda name="": "no-such-host.invalid"
'''


def _rows(summary: str) -> dict[str, list[str]]:
    rows = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and re.match(r"\d ", cells[0]):
            rows[cells[0].split()[0]] = cells[1:]
    return rows


def test_rehearsal_of_the_cheap_stages_fills_every_row_inside_its_cap(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(UNRESOLVABLE_HOST)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_PYTHON", "GPU_CHECK_CAPS")}
    env.update(OUT=str(out), GPU_CHECK_DD_MIB="16", OMP_NUM_THREADS="1", NVME_PATH=str(tmp_path / "nvme"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])))
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--rehearse", "--stages", "setup,preflight,maxscale"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    summary = (out / "summary.md").read_text()
    work = Path(re.search(r"\(not brought back\): (\S+)", summary).group(1))
    try:
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = _rows(summary)
        assert sorted(rows) == ["0", "1", "5"], summary
        for number, (status, seconds, figures) in rows.items():
            took, cap = (int(x) for x in re.match(r"(\d+) \((\d+)\)", seconds).groups())
            assert status == "PASS" and took <= cap and figures and "no figures" not in figures, (number, summary)
        assert "rehearsal, CPU: no set-up" in rows["0"][2]
        assert re.search(r"fp32 512\^3 matmul: median [0-9.]+ TFLOP/s .*s after 0.5 s of warm-up", rows["1"][2])
        # The engine's own report: states on each tier, SSD included (the stage's point).
        states = re.search(r"engine's states GiB: device ([0-9.]+), host ([0-9.]+), nvme ([0-9.]+)", rows["5"][2])
        assert states and float(states.group(3)) > 0, rows["5"][2]
        assert "127.0.0.1" in (work / "maxscale.log").read_text()  # the job's torchrun rendezvoused on loopback
    finally:
        shutil.rmtree(work, ignore_errors=True)
