"""benchmarks/profile_overlap.py's reading of a profiler trace (gpu_check.sh stage 4), on synthetic traces: the
copy time inside compute kernels' intervals, and the verdict when copies run on the compute stream."""
from benchmarks.profile_overlap import overlap_report


def _event(cat, name, ts, dur, stream):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_copy_time_inside_compute_kernels_is_hidden():
    events = [_event("kernel", "gemm", 0, 100, 7), _event("kernel", "gemm", 150, 100, 7),
              _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 100, 20),  # 50 us of it inside compute
              _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 200, 100, 24),  # 50 us inside
              _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 500, 7),  # not a host transfer
              _event("kernel", "cast", 60, 10, 20),  # a conversion on the copy stream is not compute
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0}]
    report = overlap_report(events)
    assert (report.copies, report.kernels) == (2, 2)
    assert abs(report.copy_seconds - 200e-6) < 1e-12 and abs(report.hidden_seconds - 100e-6) < 1e-12
    assert report.hidden == 0.5 and report.concurrent
    assert report.copy_streams == (20, 24) and report.compute_streams == (7,)
    assert "50% hidden" in report.line()


def test_copies_on_the_compute_stream_are_not_concurrent():
    events = [_event("kernel", "gemm", 0, 100, 7), _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 100, 50, 7),
              _event("kernel", "gemm", 150, 100, 7)]
    report = overlap_report(events)
    assert report.copies == 1 and report.kernels == 0 and not report.concurrent
