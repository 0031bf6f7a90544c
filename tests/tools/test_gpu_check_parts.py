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


def test_pytest_counts_and_a_run_that_only_skipped(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("FAILED tests/cuda/a.py::t1 - AssertionError\n=== 1 failed, 5 passed in 9.1s ===\n")
    assert rep.tests_figures(str(log)) == ("1 failed, 5 passed in 9.1s; FAILED tests/cuda/a.py::t1 - AssertionError",
                                           None)
    log.write_text("14 skipped in 10.6s\n")
    assert rep.tests_figures(str(log)) == ("14 skipped in 10.6s", "SKIPPED")  # no GPU seen


def _peers(tmp_path, offload=False):
    keys = ("ours-offload", "fsdp2-offload") if offload else ("ours-trainer", "fsdp2")
    path = tmp_path / f"{keys[0]}.json"
    path.write_text(json.dumps({
        "header": "GPT 1.3B", "loss_rtol": 1e-2, "reference": keys[1],
        "results": [{"key": keys[0], "status": "ok", "error": "",
                     "overlap": {"copies": 3, "hidden": 0.75, "copy_seconds": 0.2} if offload else None},
                    {"key": keys[1], "status": "ok", "error": "", "overlap": None},
                    {"key": "deepspeed", "status": "not installed", "error": "`import deepspeed` fails"},
                    {"key": "megatron", "status": "timeout", "error": "killed after 70 s"}],
        "figures": {keys[0]: {"tokens_per_s": 30000.0, "mfu": 0.45, "loss_diff": 2e-3},
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
           "Megatron timeout; ours (trainer) / FSDP2 1.20x; losses agree (max 2.0e-03 vs fsdp2)" in text
    assert "(note: megatron: killed after 70 s)" in text  # a job that did not finish is named even in a PASS row
    assert "ours+offload / FSDP2+offload 1.20x" in text and "75% of copies hidden" in text
    assert "| 4 offload | FAIL(rc=1) | 10 (60) | megatron: killed after 70 s / " in text
    assert "| 5 largest | FAIL(rc=1) | 10 (60) | RuntimeError: CUDA error: out of memory / really |" in text
    assert "- a note" in text and "#### 3 dense" in text and "GPT 1.3B" in text
    state = json.loads((tmp_path / "f.json").read_text())
    assert [s["name"] for s in state["stages"]] == ["preflight", "dense", "offload", "maxscale"]
    assert [s["kind"] for s in state["stages"]] == ["preflight", "peers", "peers", "maxscale"]
    assert (tmp_path / "l").read_text().count("=====") == 2 * 4  # one log tail per stage


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


def test_matmul_peak_on_cpu_writes_its_median(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert matmul_peak.main(["--device", "cpu", "--dtype", "fp32", "--size", "64", "--warmup", "1", "--samples",
                             "3", "--per-sample", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["min_tflops"] <= res["median_tflops"] <= res["max_tflops"] and len(res["tflops"]) == 3
    assert res["machine"]["torch"] and "fp32 64^3 matmul median" in capsys.readouterr().out


def test_usage_errors_are_one_line(capsys):
    p = OneLineParser(prog="prog")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "x"])
    assert e.value.code == 2 and capsys.readouterr().err == "prog: error: argument --n: invalid int value: 'x'\n"
