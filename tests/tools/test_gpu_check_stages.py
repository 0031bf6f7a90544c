"""The programs gpu_check.sh's GPU stages run, in their reduced CPU form (gloo, fp32, a tiny GPT): the
peer-comparison driver trains the trainer's and the workers' jobs (ours, host offload with a profiled step,
FSDP2) to the same losses and its record feeds the summary; it keeps its record when out of time or stopped by
SIGTERM (the stage's limit), with the steps the running job had done, and leaves no process behind; the
max-scale driver plans, trains and measures per tier."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def _module(module, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _report(tmp_path, *args):
    base = ["--state", str(tmp_path / "f.json"), "--summary", str(tmp_path / "s.md"), "--logs", str(tmp_path / "l.txt")]
    for cmd in (["init", "--budget", "400"], ["stage", *args]):
        proc = _module("benchmarks.gpu_check_report", *base, *cmd)
        assert proc.returncode == 0, proc.stderr
    return (tmp_path / "s.md").read_text()


def test_peers_on_cpu_train_the_same_losses_and_feed_the_summary(tmp_path):
    out = tmp_path / "peers.json"
    proc = _module("benchmarks.gpu_peers", "--device", "cpu", "--preset", "tiny", "--systems", "ours-trainer",
                   "ours-offload", "fsdp2", "deepspeed", "--warmup", "1", "--steps", "2", "--profile-steps", "1",
                   "--peak-tflops", "0.05", "--run-dir", str(tmp_path / "run"), "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    by = {r["key"]: r for r in res["results"]}
    assert [by[k]["status"] for k in ("ours-trainer", "ours-offload", "fsdp2")] == ["ok"] * 3
    if by["deepspeed"]["status"] != "ok":  # an optional row: says why it did not run
        assert by["deepspeed"]["status"] == "not installed" and "import deepspeed" in by["deepspeed"]["error"]
    assert res["reference"] == "fsdp2" and res["loss_rtol"] == 1e-4
    for key in ("ours-trainer", "ours-offload"):
        r, f = by[key], res["figures"][key]
        assert len(r["losses"]) == len(r["step_s"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        # The trainer's mock batches and seeded weights are the workers': the same loss at every step.
        assert f["loss_diff"] <= 1e-4, (key, r["losses"], by["fsdp2"]["losses"])
        assert f["mfu"] == pytest.approx(f["tflops"] / 0.05) and f["tokens_per_s"] == pytest.approx(
            res["spec"]["global_batch"] * res["spec"]["seq"] / f["median_step_s"])
    for key in ("ours-offload", "fsdp2"):  # every worker's profiled step was traced and read (CPU: no copies)
        overlap = by[key]["overlap"]
        assert overlap["copies"] == 0 and os.path.isfile(overlap["trace"])
        assert len(by[key]["losses"]) == 3  # the profiled step is not one of the timed ones
    assert by["ours-trainer"]["overlap"] is None  # the trainer has no profiler hook
    assert [(x["ours"], x["peer"]) for x in res["ratios"]] == [("ours-trainer", "fsdp2")]
    # header, rule, one row per system, a blank line, the ratio, a blank line, the conventions (one GPU's too)
    assert len(res["table"]) == 2 + 4 + 2 + 1 + 3 and "causal mask's skipped half counted in full" in res["table"][-3]
    assert res["planned"]["none"]["why"] == "the planner predicts accelerator steps only"  # on a CPU

    summary = _report(tmp_path, "--name", "dense", "--title", "3 dense", "--rc", "0", "--seconds", "30", "--cap",
                      "140", "--result", str(out))
    assert "ours (trainer) / FSDP2" in summary and "losses agree" in summary and "#### 3 dense" in summary
    assert "| ours: pretrain_gpt.py --deepspeed (zero_cache ZeRO-3) |" in summary


def test_peers_out_of_time_run_no_job_and_still_write_the_record(tmp_path):
    out = tmp_path / "peers.json"
    proc = _module("benchmarks.gpu_peers", "--device", "cpu", "--systems", "ours", "fsdp2", "--budget-s", "5",
                   "--min-job-s", "30", "--run-dir", str(tmp_path / "run"), "--json", str(out))
    assert proc.returncode == 0  # left out for time is a row that says so, not a failure
    res = json.loads(out.read_text())
    assert [(r["status"], "of --budget-s 5 left" in r["error"]) for r in res["results"]] == [("not run", True)] * 2
    assert "| ours: zero_cache ZeRO-3 (peer worker) | not run:" in "\n".join(res["table"])


def test_sigterm_stops_the_running_job_and_keeps_the_record(tmp_path):
    out, run = tmp_path / "peers.json", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_peers", "--device", "cpu", "--systems", "fsdp2",
                             "ours", "--steps", "500", "--run-dir", str(run), "--json", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run / "fsdp2" / "log.txt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "[fsdp2] step 1/" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 124 and "stopped by SIGTERM" in err
    res = json.loads(out.read_text())
    cut, later = res["results"]
    assert cut["status"] == "incomplete" and cut["error"].startswith("stopped by SIGTERM after ")
    assert len(cut["losses"]) == len(cut["step_s"]) >= 1  # the steps it had done are kept
    assert any("[fsdp2] step 1/" in ln for ln in cut["log_tail"])  # and its log's last lines
    assert later["status"] == "not run" and "stopped by SIGTERM" in later["error"]
    left = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not left, left  # the job's torchrun and its rank went with it


def test_max_scale_on_cpu_plans_trains_three_steps_and_reports_each_tier(tmp_path):
    out, scratch = tmp_path / "ms.json", tmp_path / "scratch"
    proc = _module("benchmarks.gpu_max_scale", "--device", "cpu", "--family", "128,4,512", "--seq", "64",
                   "--layers", "2", "--slice-host-gib", "2", "--slice-disk-gib", "1", "--no-whole-machine",
                   "--device-rate", "0", "--nvme-path", str(scratch), "--budget-s", "180", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and res["scratch"]["path"] == str(scratch)
    assert res["scratch"]["why"].startswith("given with --nvme-path")
    assert res["trained_plan"]["layers"] == 2 and set(res["trained_plan"]["need_gib"]) == {"device", "host", "nvme"}
    run = res["run"]
    assert len(run["steps"]) == 3 and all(math.isfinite(x) for x in run["losses"]) and run["step_s"] > 0
    assert run["peak_gib"]["peak rss"] > 0 and os.path.isfile(run["log"])
    assert run["states_gib"]["nvme"] > 0  # the engine's own report: states on the SSD tier (--offload nvme)
    assert not (scratch / "zc_pages").exists()  # the page files are removed, the folder given is kept
    summary = _report(tmp_path, "--name", "maxscale", "--title", "5 largest", "--rc", "0", "--seconds", "20",
                      "--cap", "65", "--result", str(out))
    assert "| tier | planned need (GiB) | measured peak (GiB) |" in summary and "| host | " in summary
