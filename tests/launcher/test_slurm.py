"""A real Slurm: examples/slurm/pretrain.sbatch on a one-machine cluster (scripts/slurm_local.sh, as root).

In both launch modes of the script (plain srun + torchrun, and ptm-launch --launcher slurm) rank 1 is killed
with SIGKILL after the checkpoint of iteration 6: the job restarts every rank from it, finishes with exit code 0
and the losses of the uninterrupted run. Skipped where Slurm is not installed (no sinfo) or not as root.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.launcher.launch_utils import REPO, gpt_losses_by_iteration, tiny_gpt_args, tiny_gpt_losses

pytestmark = pytest.mark.multiprocess

SETUP = REPO / "scripts" / "slurm_local.sh"
SBATCH = REPO / "examples" / "slurm" / "pretrain.sbatch"
VENV_PYTHON = sys.executable


@pytest.fixture(scope="module")
def slurm_env():
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        pytest.skip("Slurm is not installed here (no sinfo/sbatch on PATH); to run these tests: apt-get install "
                    "slurm-wlm munge, then they start a one-machine cluster with scripts/slurm_local.sh")
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start munged, slurmctld and slurmd (scripts/slurm_local.sh): run them as root")
    up = subprocess.run(["bash", str(SETUP), "up"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, f"{SETUP} up failed:\n{up.stderr}"
    yield {**os.environ, "SLURM_CONF": up.stdout.strip().splitlines()[-1]}
    if "already up" not in up.stderr:  # leave a cluster that was running before as it was
        subprocess.run(["bash", str(SETUP), "down"], capture_output=True, text=True, timeout=120, check=True)


def _job_workers(job_id: str) -> dict[int, int]:
    """{RANK: pid} of the job's training processes (the cluster is this machine)."""
    ranks = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("SLURM_JOB_ID") == job_id and "RANK" in env and "pretrain_gpt.py" in proc.cmdline():
                ranks[int(env["RANK"])] = proc.pid
        except psutil.Error:
            continue
    return ranks


def _wait_for(path: Path, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not in {path} within {timeout}s:\n{text}")


@pytest.mark.parametrize("launcher", ["srun", "ptm-launch"])
def test_sbatch_example_restarts_a_killed_rank_and_finishes(slurm_env, tmp_path, launcher):
    expected = tiny_gpt_losses()
    out = tmp_path / "job.out"
    env = {**slurm_env, "NPROC": "2", "MAX_RESTARTS": "1", "CKPT_DIR": str(tmp_path / "ckpt"), "SAVE_INTERVAL": "3",
           "PYTHON": VENV_PYTHON, "LAUNCHER": launcher, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    # This cluster has no GPUs and few CPUs: those directives of the script are overridden for it.
    job = subprocess.Popen(["sbatch", "--wait", "--parsable", "--nodes=1", "--gpus-per-node=0",
                            "--cpus-per-task=1", f"--output={out}", "--time=10", str(SBATCH), *tiny_gpt_args()],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job_id = job.stdout.readline().strip().split(";")[0]
        assert job_id.isdigit(), job.stderr.read()
        _wait_for(out, r"iteration\s+7/", timeout=300)
        os.kill(_job_workers(job_id)[1], signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            subprocess.run(["scancel", job_id], env=slurm_env, check=False)
            job.kill()
    text = out.read_text(errors="replace")
    assert job.returncode == 0, f"sbatch: {stderr}\n{text}"
    assert f"[pretrain.sbatch] job {job_id}: 1 node(s) x 2 process(es)" in text
    resumed = int(re.search(r"loaded checkpoint \S+/iter_(\d+)", text)[1])
    assert resumed >= 6
    if launcher == "ptm-launch":
        assert re.search(rf"ptm-launch: restart 1 of 1: rank 1 \(\S+, local rank 1\) was killed by SIGKILL; "
                         rf"restarting all ranks from iteration {resumed} ", text), text
    else:
        assert "failed (exitcode: -9) local_rank: 1" in text  # torchrun's own log of the restart
    assert gpt_losses_by_iteration(text) == expected


def test_scancel_signal_to_every_process_saves_and_the_job_exits_zero(slurm_env, tmp_path):
    """Preemption as Slurm sends it (``scancel --signal=TERM --full``: every process of the job, the batch
    script's ptm-launch, the srun step's agent, torchrun, ranks and data-loader workers): the step is finished
    and saved, and every layer exits 0."""
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    env = {**slurm_env, "NPROC": "2", "MAX_RESTARTS": "1", "CKPT_DIR": str(ckpt), "SAVE_INTERVAL": "1000",
           "PYTHON": VENV_PYTHON, "LAUNCHER": "ptm-launch", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    args = tiny_gpt_args(1000)
    args[args.index("--num-workers") + 1] = "1"
    job = subprocess.Popen(["sbatch", "--wait", "--parsable", "--nodes=1", "--gpus-per-node=0",
                            "--cpus-per-task=1", f"--output={out}", "--time=10", str(SBATCH), *args,
                            "--exit-signal-handler"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        job_id = job.stdout.readline().strip().split(";")[0]
        assert job_id.isdigit(), job.stderr.read()
        _wait_for(out, r"iteration\s+3/", timeout=300)
        subprocess.run(["scancel", "--signal=TERM", "--full", job_id], env=slurm_env, check=True)
        stdout, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            subprocess.run(["scancel", job_id], env=slurm_env, check=False)
            job.kill()
    text = out.read_text(errors="replace")
    assert job.returncode == 0, f"sbatch: {stderr}\n{text}"
    stopped = int(re.search(r"SIGTERM received: stopping at iteration (\d+) after saving it", text)[1])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert "every rank finished its step and exited 0" in text and "Traceback" not in text, text
