"""benchmarks/gpu_check.sh --dry-run: lists its four stages (with the flags that matter) and touches nothing;
without OUT its files go to a new folder under benchmarks/logs/, which git ignores. The overlap stage's trace
reading is checked in test_profile_overlap.py."""
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, env=None):
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**base, **(env or {})})


def test_dry_run_lists_the_four_stages(tmp_path):
    out = tmp_path / "out"
    proc = _run("--dry-run", env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    lines = [ln[2:] for ln in proc.stdout.splitlines() if ln.startswith("+ ")]
    assert lines[0] == "source scripts/bootstrap.sh dev"  # a fresh machine is set up first

    tests = [ln for ln in lines if re.search(r"-m pytest tests/cuda\b", ln)]
    assert len(tests) == 1

    trainers = [ln for ln in lines if "-m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py" in ln]
    assert len(trainers) == 2
    dense, maxscale = trainers
    for flag in ("--num-layers 24", "--hidden-size 2048", "--num-attention-heads 16", "--seq-length 2048",
                 "--micro-batch-size 4", "--bf16", "--train-iters 20", "--mock-data",
                 "--tokenizer-type NullTokenizer", "--vocab-size 32000"):
        assert f"{flag} " in f"{dense} ", flag
    assert "--deepspeed" not in dense  # no offload

    planner = [ln for ln in lines if "tools/plan_memory.py" in ln]
    assert len(planner) == 1
    for flag in ("--device cuda", "--hidden-size 8192", "--num-attention-heads 64", "--ffn-hidden-size 32768",
                 "--seq-length 2048", "--vocab-size 32000", "--largest", "--nproc-per-node 1",
                 f"--write-ds-config {out}/maxscale.json", f"--write-args {out}/maxscale.args"):
        assert f"{flag} " in f"{planner[0]} ", flag
    assert lines.index(planner[0]) < lines.index(maxscale)  # the plan comes before the run that uses it
    assert f"$(cat {out}/maxscale.args) --train-iters 3 --deepspeed --deepspeed_config {out}/maxscale.json" in maxscale

    overlap = [ln for ln in lines if "-m benchmarks.profile_overlap" in ln]
    assert overlap == [f"python -m benchmarks.profile_overlap --out {out}/overlap"]
    assert lines.index(dense) < lines.index(overlap[0]) < lines.index(planner[0])  # the last stage takes the rest
    assert not out.exists()  # a dry run runs nothing and writes nothing


def test_default_output_folder_is_under_benchmarks_logs():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    planner = next(ln for ln in proc.stdout.splitlines() if "tools/plan_memory.py" in ln)
    match = re.search(r"--write-ds-config (\S+)/maxscale\.json", planner)
    assert match, planner
    work = Path(match.group(1))
    assert work.parent == ROOT / "benchmarks" / "logs" and work.name.startswith("gpu_check-")
    assert not work.exists()  # a dry run creates nothing


def test_unknown_argument_is_a_usage_error():
    proc = _run("--bogus")
    assert proc.returncode == 2 and "usage: bash benchmarks/gpu_check.sh [--dry-run]" in proc.stderr
