"""gpu_check.sh's parts that need no process: the record and its summary (benchmarks/gpu_check_report.py), the
scratch folder choice of benchmarks/gpu_max_scale.py, the matmul peak probe on a CPU, one-line usage errors."""
import json

import pytest

from benchmarks import gpu_check_report as rep
from benchmarks import gpu_max_scale, matmul_peak
from benchmarks.one_line_args import OneLineParser


def test_status_and_the_telling_error_line(tmp_path):
    assert [rep.status_of(rc) for rc in (0, 124, 137, 3)] == ["PASS", "TIMEOUT", "TIMEOUT", "FAIL(rc=3)"]
    log = tmp_path / "x.log"
    log.write_text("start\nTraceback (most recent call last):\n  File x\nValueError: bad shape\nexiting\n")
    assert rep.last_error(str(log)) == "ValueError: bad shape"
    log.write_text("only this\n")
    assert rep.last_error(str(log)) == "only this" and rep.last_error(str(tmp_path / "none")) == "(no output)"


def test_pytest_per_test_outcomes_even_from_a_run_cut_before_its_totals(tmp_path):
    log = tmp_path / "t.log"
    # Under xdist (-n 4 -v): one line per test as it ends; this run was killed before its totals line.
    log.write_text("created: 4/4 workers\n4 workers [5 items]\n\n"
                   "[gw0] [ 20%] PASSED tests/cuda/a.py::t0\n[gw1] [ 40%] FAILED tests/cuda/a.py::t1\n"
                   "[gw2] [ 60%] SKIPPED tests/cuda/b.py::t2[bf16]\n")
    figures, status, res = rep.tests_figures(str(log))
    assert figures == "1 passed, 1 failed, 1 skipped of 5 collected; 2 not finished (cut); failed: tests/cuda/a.py::t1"
    assert status is None and res == {"tests": {"tests/cuda/a.py::t0": "PASSED", "tests/cuda/a.py::t1": "FAILED",
                                                "tests/cuda/b.py::t2[bf16]": "SKIPPED"}, "collected": 5}
    # Without xdist, finished: a teardown error after PASSED is the test's outcome.
    log.write_text("collected 2 items\n\ntests/cuda/a.py::t0 PASSED [ 50%]\ntests/cuda/a.py::t0 ERROR [ 50%]\n"
                   "tests/cuda/a.py::t1 PASSED [100%]\n=== 1 passed, 1 error in 9.1s ===\n")
    figures, status, res = rep.tests_figures(str(log))
    assert figures == "1 passed, 1 error of 2 collected; failed: tests/cuda/a.py::t0"
    assert res["tests"]["tests/cuda/a.py::t0"] == "ERROR"
    log.write_text("4 workers [2 items]\n[gw0] [ 50%] SKIPPED tests/cuda/a.py::t0\n"
                   "[gw1] [100%] SKIPPED tests/cuda/a.py::t1\n=== 2 skipped in 10.6s ===\n")
    assert rep.tests_figures(str(log))[:2] == ("2 skipped of 2 collected", "SKIPPED")  # no GPU seen


def _peers(tmp_path, offload=False):
    keys = ("ours-offload", "fsdp2-offload") if offload else ("ours-trainer", "fsdp2")
    path = tmp_path / f"{keys[0]}.json"
    path.write_text(json.dumps({
        "header": "GPT 1.3B", "loss_rtol": 1e-2, "reference": keys[1],
        "results": [{"key": keys[0], "status": "ok", "error": "",
                     "overlap": {"copies": 3, "hidden": 0.75, "copy_seconds": 0.2} if offload else None},
                    {"key": keys[1], "status": "ok", "error": "", "overlap": None},
                    {"key": "deepspeed", "status": "not installed", "error": "`import deepspeed` fails"},
                    {"key": "megatron", "status": "incomplete", "error": "killed after 70 s", "step_s": [9.5, 0.31],
                     "log_tail": ["iteration 2/ 8 | elapsed time per iteration (ms): 310.0"]},
                    {"key": "ours", "status": "failed", "error": "RuntimeError: boom", "step_s": [],
                     "log_tail": ["Traceback (most recent call last):", "RuntimeError: boom"]}],
        "figures": {keys[0]: {"tokens_per_s": 30000.0, "mfu": 0.45, "loss_diff": 2e-3, "predicted_step_s": 0.25,
                              "median_step_s": 0.3, "predicted_over_measured": 0.25 / 0.3},
                    keys[1]: {"tokens_per_s": 25000.0, "mfu": 0.375}},
        "ratios": [{"ours": keys[0], "peer": keys[1], "ratio": 1.2}], "table": ["| system | tokens/s |", "|---|---|"]}))
    return path


def test_summary_after_each_stage_has_the_machine_the_peak_the_rows_and_the_ratios(tmp_path):
    files = ["--state", str(tmp_path / "f.json"), "--summary", str(tmp_path / "s.md"), "--logs", str(tmp_path / "l")]
    no_record = [*files, "stage", "--name", "x", "--title", "x", "--rc", "0", "--seconds", "1", "--cap", "1"]
    assert rep.main(no_record) == 2  # no record yet
    assert rep.main([*files, "init", "--budget", "465"]) == 0
    machine = tmp_path / "machine.txt"
    machine.write_text("gpu_name=NVIDIA H200\ndriver=570.1\ncores=16\nram_total_gib=128\nram_available_gib=120\n"
                       "disk_write=2.1 GB/s\ndisk_write_where=benchmarks/logs\nnot a pair\n")
    assert rep.main([*files, "machine", str(machine)]) == 0
    peak = tmp_path / "peak.json"
    peak.write_text(json.dumps({"machine": {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "python": "3.12.3",
                                            "cuda": "13.0", "device_memory_gib": 139.8},
                                "size": 8192, "samples": 20, "per_sample": 10, "median_tflops": 741.0,
                                "min_tflops": 730.0, "max_tflops": 748.0}))
    log = tmp_path / "stage.log"
    log.write_text("+ cmd\nRuntimeError: CUDA error: out of memory | really\n")
    # The name says how a stage's result is read (dense and offload: gpu_peers's JSON).
    stages = [("preflight", "1 preflight", 0, ["--result", str(peak)]),
              ("dense", "3 dense", 0, ["--result", str(_peers(tmp_path))]),
              ("offload", "4 offload", 1, ["--result", str(_peers(tmp_path, offload=True))]),
              ("maxscale", "5 largest", 1, ["--result", str(tmp_path / "missing.json")])]
    for name, title, rc, extra in stages:
        assert rep.main([*files, "stage", "--name", name, "--title", title, "--rc", str(rc), "--seconds", "10",
                         "--cap", "60", "--log", str(log), *extra]) == 0
        assert f"| {title} |" in (tmp_path / "s.md").read_text()  # rewritten at once
    assert rep.main([*files, "note", "a note"]) == 0
    text = (tmp_path / "s.md").read_text()
    assert text.startswith("### GPU check, ") and "NVIDIA H200 (139.8 GiB), driver 570.1, torch 2.11.0+cu130 " \
                                                  "(CUDA 13.0), python 3.12.3, 16 cores, 128 GiB RAM" in text
    assert "**741 TFLOP/s**" in text and "75% of it" in text  # against the datasheet's 989
    assert "| 3 dense | PASS | 10 (60) | ours (trainer) 30,000 tok/s (MFU 45%); FSDP2 25,000 tok/s (MFU 38%); " \
           "Megatron incomplete (2 step(s) done: 9.50, 0.31 s); ours (worker) failed; ours (trainer) / FSDP2 1.20x; " \
           "losses agree (max 2.0e-03 vs fsdp2); planner predicted / measured: ours (trainer) 0.25 / 0.30 s" in text
    assert "(note: megatron: killed after 70 s)" in text  # a job that did not finish is named even in a PASS row
    # Each failed or incomplete job's last log lines come back, in the summary and in logs.txt.
    assert "3 dense / ours:\n\n```\nTraceback (most recent call last):\nRuntimeError: boom\n```" in text
    logs = (tmp_path / "l").read_text()
    assert "===== 3 dense / megatron: its log's last 1 lines =====\niteration 2/ 8" in logs
    assert "ours+offload / FSDP2+offload 1.20x" in text and "75% of copies hidden" in text
    assert "| 4 offload | FAIL(rc=1) | 10 (60) | megatron: killed after 70 s / " in text
    assert "| 5 largest | FAIL(rc=1) | 10 (60) | RuntimeError: CUDA error: out of memory / really |" in text
    assert "- a note" in text and "#### 3 dense" in text and "GPT 1.3B" in text
    state = json.loads((tmp_path / "f.json").read_text())
    assert [s["name"] for s in state["stages"]] == ["preflight", "dense", "offload", "maxscale"]
    assert [s["kind"] for s in state["stages"]] == ["preflight", "peers", "peers", "maxscale"]
    assert logs.count("===== ") == 4 + 2 * 2  # one log tail per stage, and the two jobs' of dense and of offload


def test_a_stage_recorded_again_replaces_its_row(tmp_path):
    files = ["--state", str(tmp_path / "f.json"), "--summary", str(tmp_path / "s.md")]
    rep.main([*files, "init", "--budget", "100"])
    for rc in (1, 0):
        rep.main([*files, "stage", "--name", "setup", "--title", "0 set-up", "--rc", str(rc), "--seconds", "1",
                  "--cap", "30", "--figures", "python3"])
    assert json.loads((tmp_path / "f.json").read_text())["stages"][0]["status"] == "PASS"
    rep.main([*files, "stage", "--name", "dense", "--title", "3 dense", "--rc", "0", "--seconds", "0", "--cap", "140",
              "--status", "SKIPPED", "--figures", "no CUDA device"])
    assert "| 3 dense | SKIPPED | 0 (140) | no CUDA device |" in (tmp_path / "s.md").read_text()


def test_scratch_is_the_first_disk_backed_folder_and_never_memory_unless_given(monkeypatch, tmp_path):
    kinds = {}
    monkeypatch.setattr(gpu_max_scale, "fs_type", lambda path: kinds.get(path, "ext4"))
    monkeypatch.setattr(gpu_max_scale, "LOGS_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(gpu_max_scale.tempfile, "gettempdir", lambda: "/tmp")
    kinds.update({str(tmp_path): "tmpfs", "/var/tmp": "xfs", "/tmp": "tmpfs"})
    got = gpu_max_scale.choose_scratch(None)
    assert got["path"] == "/var/tmp/zc_gpu_max_scale" and got["fstype"] == "xfs" and "/tmp is tmpfs" in got["why"]
    kinds.update({"/var/tmp": "ramfs", "/": "tmpfs"})
    with pytest.raises(RuntimeError, match="no disk-backed scratch folder"):
        gpu_max_scale.choose_scratch(None)
    given = gpu_max_scale.choose_scratch(str(tmp_path / "mine"))
    assert given["fstype"] == "tmpfs" and "tmpfs is memory, not disk" in given["why"]
    kinds.clear()
    assert gpu_max_scale.choose_scratch(None)["why"].startswith("the repository's disk")


def test_fs_type_reads_the_mount_table():
    assert gpu_max_scale.fs_type("/") not in ("", "unknown")


def test_matmul_peak_on_cpu_times_several_groups_for_about_the_seconds_asked(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert matmul_peak.main(["--device", "cpu", "--dtype", "fp32", "--size", "64", "--warmup-s", "0.2", "--samples",
                             "3", "--seconds", "0.6", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["min_tflops"] <= res["median_tflops"] <= res["max_tflops"] and len(res["tflops"]) == 3
    # Groups sized from the warm-up's speed: many small matmuls each. The warm-up is timed by the clock, so the
    # run lasts at least that long; the groups' own time follows the machine's load and is only bounded above.
    assert res["per_sample"] > 10 and 0.2 <= res["seconds"] < 5
    assert res["machine"]["torch"] and "fp32 64^3 matmul median" in capsys.readouterr().out


def test_usage_errors_are_one_line(capsys):
    p = OneLineParser(prog="prog")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "x"])
    assert e.value.code == 2 and capsys.readouterr().err == "prog: error: argument --n: invalid int value: 'x'\n"


def _trainer_log(path, nvme_gib: float, steps: int = 3):
    lines = [f" iteration {i}/ {steps} | elapsed time per iteration (ms): 900.0 | lm loss: 1.0E+01 | mem (GiB) "
             f"peak rss: 3.1, host states: 1.50, device states: 6.00, nvme states: {nvme_gib:.2f}"
             for i in range(1, steps + 1)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_max_scale_counts_the_engines_bytes_per_tier_and_fails_with_none_on_ssd(tmp_path):
    a = gpu_max_scale.parse_args(["--device", "cpu", "--steps", "3"])  # --offload nvme by default
    need = {"device": 6.0, "host": 2.0, "nvme": 1.0}
    ok = gpu_max_scale.measured(_trainer_log(tmp_path / "a.log", 1.25), 0.5, 10.0, 0, 60.0, a, need)
    assert ok["status"] == "ok" and ok["states_gib"] == {"host": 1.5, "device": 6.0, "nvme": 1.25}
    assert ok["fixed_s"] == pytest.approx(10.0 - 2.7)  # the run's seconds outside its steps
    none = gpu_max_scale.measured(_trainer_log(tmp_path / "b.log", 0.0), 0.0, 10.0, 0, 60.0, a, need)
    assert none["status"] == "failed" and "the engine reports no states there" in none["error"]
    assert none["log_tail"][-1].endswith("nvme states: 0.00")  # its log's last lines come back
    cut = gpu_max_scale.measured(_trainer_log(tmp_path / "c.log", 1.0, steps=1), 0.5, 60.0, None, 60.0, a, need)
    assert cut["status"] == "incomplete" and "killed after 60 s (1 steps logged)" in cut["error"]
