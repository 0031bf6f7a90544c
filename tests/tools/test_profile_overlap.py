"""benchmarks/profile_overlap.py's reading of a profiler trace (used by the peer workers' profiled steps in
gpu_check.sh's offload stage), on synthetic traces: the copy time under the compute stream's kernels, copies
issued on the compute stream itself, and the --trace command line."""
import json

from benchmarks.profile_overlap import main
from benchmarks.trace_overlap import overlap_report


def _event(cat, name, ts, dur, stream):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_copy_time_under_the_compute_streams_kernels_is_hidden():
    events = [_event("kernel", "gemm", 0, 100, 7), _event("kernel", "gemm", 150, 100, 7),
              _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 100, 20),  # 50 us of it under compute
              _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 200, 100, 24),  # 50 us under
              _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 500, 7),  # not a host transfer
              _event("kernel", "cast", 100, 40, 20),  # a conversion on a copy stream is not compute
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0}]
    report = overlap_report(events)
    assert (report.copies, report.kernels) == (2, 2)
    assert abs(report.copy_seconds - 200e-6) < 1e-12 and abs(report.hidden_seconds - 100e-6) < 1e-12
    assert report.hidden == 0.5 and report.concurrent and report.same_stream_seconds == 0
    assert report.copy_streams == (20, 24) and report.compute_streams == (7,)
    assert "50% hidden" in report.line()


def test_the_compute_stream_is_the_busiest_one_not_any_stream_without_copies():
    # Copies on the GEMM stream, a short side-stream kernel beside them: serialised, nothing hidden.
    events = [_event("kernel", "gemm", 0, 100, 7), _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 100, 50, 7),
              _event("kernel", "gemm", 150, 100, 7), _event("kernel", "copy_out", 100, 50, 30)]
    report = overlap_report(events)
    assert report.copies == 1 and report.kernels == 2 and report.compute_streams == (7,)
    assert report.hidden == 0 and not report.concurrent
    assert abs(report.same_stream_seconds - 50e-6) < 1e-12 and "on the compute stream itself" in report.line()


def test_a_trace_without_kernels_or_copies_is_not_concurrent():
    report = overlap_report([_event("cpu_op", "aten::mm", 0, 10, 0)])  # a CPU-only trace
    assert (report.copies, report.kernels, report.compute_streams) == (0, 0, ()) and not report.concurrent


def test_trace_command_line(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [_event("kernel", "gemm", 0, 100, 7),
                                                 _event("gpu_memcpy", "Memcpy HtoD", 0, 100, 9)]}))
    assert main(["--trace", str(trace)]) == 0
    assert "100% hidden" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{")
    assert main(["--trace", str(tmp_path / "bad.json")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err
