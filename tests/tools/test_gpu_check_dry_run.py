"""benchmarks/gpu_check.sh: the --dry-run plan (every stage's command with the flags that matter, in the order that
matters, the caps and their sum under the 540 s limit, nothing touched; the rehearsal's the same jobs on CPU), and
the real script driven by a stub python (CPU, seconds): the summary is rewritten after every stage, a failed or
timed-out stage is reported with its error line and the next stage still runs, and only the few files that come
back are written to OUT. What the stages' programs measure is checked in test_gpu_check_stages.py (on CPU),
test_gpu_check_parts.py, test_gpu_check_rehearsal.py and test_profile_overlap.py."""
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["0 set-up", "1 preflight", "2 pytest tests/cuda", "3 dense", "4 host offload", "5 planner's largest"]

# A python that answers gpu_check.sh's calls quickly: it keeps a copy of the summary as it stood when each stage
# program started, then writes what the real program would (STUB_FAIL / STUB_HANG name modules that fail / hang).
STUB = r'''
import json, os, shutil, sys, time
args = sys.argv[1:]
if args[0] == "-c":
    code = args[1]
    if "print(" in code:
        print("python=stub\ntorch=stub")
    sys.exit(0)
module = args[1]
snaps = os.environ["STUB_SNAPSHOTS"]
n = len(os.listdir(snaps))
summary = os.path.join(os.environ["OUT"], "summary.md")
shutil.copy(summary, os.path.join(snaps, f"{n:02d}-{module}.md"))
if module in os.environ.get("STUB_HANG", "").split(","):
    time.sleep(60)
if module in os.environ.get("STUB_FAIL", "").split(","):
    print("RuntimeError: stub failure in " + module, file=sys.stderr)
    sys.exit(1)
def out(flag):
    return args[args.index(flag) + 1]
if module == "pytest":
    print("4 workers [4 items]")
    for k, outcome in enumerate(["PASSED", "PASSED", "SKIPPED", "PASSED"]):
        print(f"[gw{k}] [{25 * (k + 1):3d}%] {outcome} tests/cuda/test_a.py::t{k}")
    print("3 passed, 1 skipped in 1.00s")
elif module == "benchmarks.matmul_peak":
    json.dump({"machine": {"device": "Stub GPU", "torch": "stub", "python": "3", "cuda": "13.0"}, "dtype": "bf16",
               "size": 8192, "samples": 20, "per_sample": 10, "median_tflops": 700.0, "min_tflops": 690.0,
               "max_tflops": 710.0, "tflops": [700.0]}, open(out("--json"), "w"))
elif module == "benchmarks.gpu_peers":
    offload = "--profile-steps" in args
    keys = ["ours-offload", "fsdp2-offload"] if offload else ["ours-trainer", "fsdp2"]
    overlap = {"copies": 10, "hidden": 0.8, "copy_seconds": 0.5} if offload else None
    json.dump({"header": "stub GPT", "loss_rtol": 0.01, "reference": keys[1],
               "results": [{"key": k, "status": "ok", "error": "", "overlap": overlap} for k in keys],
               "figures": {keys[0]: {"tokens_per_s": 2000.0, "mfu": 0.5, "loss_diff": 1e-3},
                           keys[1]: {"tokens_per_s": 1000.0, "mfu": 0.25}},
               "ratios": [{"ours": keys[0], "peer": keys[1], "ratio": 2.0}],
               "table": ["| system | tokens/s |", "|---|---:|", f"| {keys[0]} | 2000 |", f"| {keys[1]} | 1000 |"]},
              open(out("--json"), "w"))
elif module == "benchmarks.gpu_max_scale":
    json.dump({"status": "ok", "trained_plan": {"layers": 4, "parameters": 945e6, "offload": "cpu+nvme",
               "predicted_step_s": 2.3, "message": "fits", "need_gib": {"device": 14.1, "host": 9.0, "nvme": 3.0}},
               "run": {"status": "ok", "steps": [3.0, 2.5, 2.4], "losses": [10.4, 10.3, 10.2], "step_s": 2.45,
                       "peak_gib": {"cuda max alloc": 12.0, "peak rss": 8.0}, "disk_peak_gib": 3.0}},
              open(out("--json"), "w"))
'''


def _run(*args, env=None, timeout=60):
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_PYTHON", "GPU_CHECK_CAPS")}
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def _plan(out: Path) -> tuple[str, list[str], dict[str, list[str]]]:
    proc = _run("--dry-run", env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stderr
    stages, current = {}, None
    for line in proc.stdout.splitlines():
        m = re.match(r"== stage (.+) \(cap (\d+) s\) ==", line)
        if m:
            current = m.group(1)
            stages[current] = [m.group(2)]
        elif line.startswith("+ ") and current:
            stages[current].append(line[2:])
    return proc.stdout, list(stages), stages


def test_dry_run_prints_every_stage_with_its_cap_and_a_total_under_540_s(tmp_path):
    out = tmp_path / "out"
    text, order, stages = _plan(out)
    assert [next(s for s in order if s.startswith(p)) for p in STAGES] == order  # the six stages, in order
    caps = [int(stages[s][0]) for s in order]
    total = int(re.search(r"caps sum to (\d+) s \(limit 540 s\)", text).group(1))
    assert sum(caps) == total < 540 and f"total: caps sum to {total} s of the 540 s limit" in text
    work = Path(re.search(r"raw logs: (\S+)", text).group(1))
    assert not out.exists() and not work.exists()  # a dry run writes nothing

    setup, preflight, tests, dense, offload, maxscale = (stages[s][1:] for s in order)
    # python3 as it is when it has CUDA torch and the pins; bootstrap only otherwise.
    assert setup == ["python3 -c 'import torch; torch.cuda.is_available()'",
                     "python3 scripts/check_requirements.py --log '(no pip run)' requirements.txt "
                     "requirements-dev.txt",
                     "env PIP_RETRIES=0 PIP_TIMEOUT=5 bash -c 'source scripts/bootstrap.sh dev'"]
    # The peak first, while nothing else runs, and sustained for seconds.
    assert preflight[0].startswith("python -m benchmarks.matmul_peak --size 8192 --warmup-s 2 --seconds 6 --json ")
    assert tests == [f"python -m pytest tests/cuda -v --tb=short -rs -p no:cacheprovider -n 4 --timeout 100 "
                     f"--junitxml {work}/junit.xml"]
    # The like-for-like pair first: our engine in the peers' loop, then FSDP2.
    for cmd, systems in ((dense, "ours fsdp2 ours-trainer megatron deepspeed"),
                         (offload, "ours-offload fsdp2-offload deepspeed-offload")):
        assert len(cmd) == 1 and cmd[0].startswith("python -m benchmarks.gpu_peers --preset 1.3b --dtype bf16 ")
        assert f"--systems {systems} " in cmd[0] and "--peak-json " in cmd[0]  # MFU against the measured peak
    assert "--profile-steps 1" in offload[0] and "--reference-from " in offload[0]  # losses against dense's
    for cmd, cap in ((dense[0], stages[order[3]][0]), (offload[0], stages[order[4]][0])):
        budget = int(re.search(r"--budget-s (\d+)", cmd).group(1))
        assert budget < int(cap)  # the driver stops its jobs before the stage's limit
    assert maxscale[0].startswith("python -m benchmarks.gpu_max_scale --family 4096,32,16384 --seq 2048 ")
    for flag in ("--slice-device-gib 16", "--slice-host-gib 6", "--slice-disk-gib 8", "--host-fraction 0.6",
                 "--offload nvme", "--steps 3", "--peak-json"):
        assert f"{flag} " in maxscale[0], flag


def test_the_rehearsal_plans_the_same_jobs_under_the_same_caps_on_cpu():
    gpu = _run("--dry-run")
    proc = _run("--dry-run", "--rehearse")
    assert proc.returncode == 0, proc.stderr
    caps = lambda text: re.findall(r"== stage (.+) \(cap (\d+) s\) ==", text)  # noqa: E731
    assert caps(proc.stdout) == caps(gpu.stdout)
    for module in ("matmul_peak", "gpu_peers", "gpu_max_scale"):
        assert proc.stdout.count(f"-m benchmarks.{module} ") == gpu.stdout.count(f"-m benchmarks.{module} ")
    assert "--systems ours fsdp2 ours-trainer megatron deepspeed " in proc.stdout
    assert "-m benchmarks.gpu_peers --device cpu --preset tiny --dtype fp32 " in proc.stdout
    assert "-m benchmarks.matmul_peak --device cpu --dtype fp32 " in proc.stdout
    assert "-m benchmarks.gpu_max_scale --device cpu " in proc.stdout and "--offload nvme " in proc.stdout
    assert "bootstrap" not in proc.stdout and "rehearsal, CPU: no set-up" in proc.stdout


def test_default_work_folder_is_under_benchmarks_logs():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    work = Path(re.search(r"raw logs: (\S+)", proc.stdout).group(1))
    assert work.parent == ROOT / "benchmarks" / "logs" and work.name.startswith("gpu_check-")
    assert f"brought back: {work}/{{summary.md,figures.json,logs.txt,tests.txt}}" in proc.stdout  # no OUT: same
    assert not work.exists()


@pytest.mark.parametrize("args,env,message", [
    (["--bogus"], {}, "usage: bash benchmarks/gpu_check.sh [--dry-run] [--rehearse] [--stages"),
    (["--stages", "tests,warp"], {}, "unknown stage 'warp'"),
    (["--dry-run"], {"GPU_CHECK_CAPS": "dense=400"}, "caps sum to 765 s, not under the 540 s limit"),
    (["--dry-run"], {"GPU_CHECK_CAPS": "dense=ten"}, "GPU_CHECK_CAPS takes stage=seconds pairs"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, message):
    proc = _run(*args, env=env)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


def _stub_run(tmp_path, **env):
    stub = tmp_path / "stub-python"
    stub.write_text(f"#!{sys.executable}\n{STUB}")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    snaps, out = tmp_path / "snaps", tmp_path / "out"
    snaps.mkdir()
    proc = _run(env={"OUT": str(out), "GPU_CHECK_PYTHON": str(stub), "STUB_SNAPSHOTS": str(snaps),
                     "GPU_CHECK_DD_MIB": "0", **env})
    work = Path(re.search(r"raw logs, run folders and profiler traces \(not brought back\): (\S+)",
                          (out / "summary.md").read_text()).group(1))
    return proc, out, snaps, work


def _rows(summary: str) -> dict[str, list[str]]:
    rows = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if any(cells[0].startswith(p) for p in STAGES) and len(cells) == 4:
            rows[cells[0]] = cells[1:]
    return rows


def _row(rows: dict[str, list[str]], number: str) -> list[str]:
    return next(v for k, v in rows.items() if k.startswith(f"{number} "))


def test_summary_is_rewritten_after_every_stage_and_only_the_record_comes_back(tmp_path):
    proc, out, snaps, work = _stub_run(tmp_path)
    try:
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in out.iterdir()) == ["figures.json", "logs.txt", "summary.md", "tests.txt"]
        # When each stage program started, the summary already held every earlier stage's row.
        seen = sorted(p.name for p in snaps.iterdir())
        assert [s.split("-", 1)[1] for s in seen] == ["benchmarks.matmul_peak.md", "pytest.md",
                                                      "benchmarks.gpu_peers.md", "benchmarks.gpu_peers.md",
                                                      "benchmarks.gpu_max_scale.md"]
        for k, name in enumerate(seen):
            assert len(_rows((snaps / name).read_text())) == k + 1, name  # set-up, then one more per stage
        summary = (out / "summary.md").read_text()
        rows = _rows(summary)
        assert [r[0] for r in rows.values()] == ["PASS"] * 6, summary
        assert "**700 TFLOP/s**" in summary  # the measured peak, with the datasheet as the second figure
        assert _row(rows, "2")[2] == "3 passed, 1 skipped of 4 collected"
        assert "| tests/cuda/test_a.py::t2 | SKIPPED |" in summary  # each test's outcome
        assert "[gw3] [100%] PASSED tests/cuda/test_a.py::t3" in (out / "tests.txt").read_text()
        assert "ours (trainer) / FSDP2 2.00x" in summary and "80% of copies hidden" in summary
        assert "| nvme | 3.00 | page files 3.00 |" in summary  # planned against measured, per tier
        state = json.loads((out / "figures.json").read_text())
        assert [s["name"] for s in state["stages"]] == ["setup", "preflight", "tests", "dense", "offload", "maxscale"]
        assert state["budget_s"] < 540 and all(s["cap"] > 0 for s in state["stages"])
        assert "===== 3 dense" in (out / "logs.txt").read_text()  # the logs' tails come back, not the logs
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)


def test_a_failed_and_a_timed_out_stage_are_reported_and_the_next_stages_still_run(tmp_path):
    proc, out, _, work = _stub_run(tmp_path, STUB_HANG="pytest", STUB_FAIL="benchmarks.gpu_peers",
                                   GPU_CHECK_CAPS="tests=3")
    try:
        summary = (out / "summary.md").read_text()
        rows = _rows(summary)
        status = {k.split()[0]: v[0] for k, v in rows.items()}
        assert status == {"0": "PASS", "1": "PASS", "2": "TIMEOUT", "3": "FAIL(rc=1)", "4": "FAIL(rc=1)",
                          "5": "PASS"}, summary
        assert "RuntimeError: stub failure in benchmarks.gpu_peers" in _row(rows, "3")[2]
        seconds = int(_row(rows, "2")[1].split()[0])
        assert 3 <= seconds <= 8  # cut at its cap (3 s here), not the stub's 60 s
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
