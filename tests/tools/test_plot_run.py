"""tools/plot_run.py: lines printed by the trainer's own TrainLogger parse back to the values logged, several
logs overlay in one PNG of the expected size, the summary gives steady-state figures, and a log with no
training lines is one clear error naming the file."""
from __future__ import annotations

import contextlib
import io
import json
import math
import types

import pytest
import torch
from matplotlib import image as mpimg

from megatron.training import train_log
from tools.plot_run import FIG_INCHES, LogParseError, build_figure, main, parse_log, render

GIB = 1024 ** 3
GBS, SEQ, FLOPS_PER_TOKEN, LOG_INTERVAL = 8, 128, 1e9, 4
TIERS = ("device states", "host states", "nvme states")
# Per interval: seconds per iteration (exact in binary, so the fake clock divides exactly), the losses
# recorded in it, and the engine's bytes per tier.
RUN_A = [(0.5, [4.0, 3.5, 3.25, 3.0], (0.5, 1.25, 3.0)),
         (0.25, [2.75, 2.5, 2.5, 2.25], (0.5, 1.5, 3.0)),
         (0.125, [2.0, 1.875, 1.75, 1.625], (0.75, 1.5, 2.5))]
RUN_B = [(1.0, [5.0, 4.5, 4.0, 3.5], (0.25, 2.0, 0.0)),
         (0.75, [3.0, 2.75, 2.5, 2.25], (0.25, 2.25, 0.0))]


class FakeClock:
    """Stands in for time.perf_counter inside train_log, so each interval lasts exactly what the test says."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _trainer_log(monkeypatch, intervals, path, noise: bool = True) -> None:
    """Drive TrainLogger through ``intervals`` and write its stdout (plus lines a real log also has) to path."""
    clock = FakeClock()
    monkeypatch.setattr(train_log, "time", types.SimpleNamespace(perf_counter=clock))
    logger = train_log.TrainLogger(train_iters=LOG_INTERVAL * len(intervals), global_batch_size=GBS, seq_length=SEQ,
                                   flops_per_token=FLOPS_PER_TOKEN, world_size=1, device=torch.device("cpu"),
                                   tensorboard_dir=None, is_logging_rank=True)
    lines = ["> model: 1.23M parameters, mesh TP=1 PP=1 DP=1, 1 micro-batches of 8 per step, starting at iteration 0"]
    for k, (step_s, losses, tiers) in enumerate(intervals):
        logger.interval = train_log.IntervalStats(start=clock.now)
        for loss in losses:
            logger.record(loss, skipped=False)
        clock.now += step_s * len(losses)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            logger.log((k + 1) * LOG_INTERVAL, (k + 1) * LOG_INTERVAL * GBS, lr=1e-4, loss_scale=1.0, grad_norm=0.5,
                       extra_memory={name: gib * GIB for name, gib in zip(TIERS, tiers)})
        line = out.getvalue().rstrip("\n")
        if noise:  # a launcher prefix on every other line, and lines the parser must skip
            line = f"[rank3]:{line}" if k % 2 else line
            lines += [line, "zero_cache comm step 4: all_gather: 12 calls, 3.0MiB, 1.2ms; iteration 4 done",
                      f" validation loss at iteration {(k + 1) * LOG_INTERVAL} | lm loss value: 2.0E+00 |"]
        else:
            lines.append(line)
    path.write_text("\n".join(lines) + "\n")


def _expected(intervals) -> dict:
    return {"iterations": [(k + 1) * LOG_INTERVAL for k in range(len(intervals))],
            "step_time_s": [s for s, _, _ in intervals],
            "lm_loss": [sum(losses) / len(losses) for _, losses, _ in intervals],
            "tokens_per_s": [GBS * SEQ / s for s, _, _ in intervals],
            "tflops": [GBS * SEQ / s * FLOPS_PER_TOKEN / 1e12 for s, _, _ in intervals],
            "memory_gib": {name: [t[i] for _, _, t in intervals] for i, name in enumerate(TIERS)}}


def test_trainer_lines_parse_back_to_the_logged_values(monkeypatch, tmp_path):
    path = tmp_path / "a.log"
    _trainer_log(monkeypatch, RUN_A, path)
    run, want = parse_log(str(path)), _expected(RUN_A)
    assert run.iterations == want["iterations"]
    assert run.step_time_s == want["step_time_s"]  # printed in ms with one decimal: exact for these values
    assert run.lm_loss == pytest.approx(want["lm_loss"], rel=1e-6)  # 7 significant digits
    assert run.tokens_per_s == want["tokens_per_s"]
    assert run.tflops == pytest.approx(want["tflops"], abs=0.005)  # two decimals
    for name in TIERS:
        assert run.memory_gib[name] == want["memory_gib"][name]
    # The process RSS and its peak so far are logged too (a CPU run: no cuda field).
    assert set(run.memory_gib) == {*TIERS, "rss", "peak rss"}
    assert all(0 < x < 64 for x in run.memory_gib["rss"])
    assert all(now <= peak for now, peak in zip(run.memory_gib["rss"], run.memory_gib["peak rss"]))


def test_overlaid_logs_render_to_a_png_of_the_expected_size(monkeypatch, tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    _trainer_log(monkeypatch, RUN_A, a)
    _trainer_log(monkeypatch, RUN_B, b, noise=False)
    runs = [parse_log(str(a)), parse_log(str(b))]
    step_ax, mem_ax, loss_ax = build_figure(runs).axes
    assert [ln.get_label() for ln in step_ax.lines] == ["a.log", "b.log"]
    assert list(step_ax.lines[1].get_ydata()) == [s for s, _, _ in RUN_B]
    assert list(loss_ax.lines[0].get_ydata()) == pytest.approx(_expected(RUN_A)["lm_loss"], rel=1e-6)
    mem = {ln.get_label(): list(ln.get_ydata()) for ln in mem_ax.lines}
    assert len(mem) == 10  # 2 logs x (rss, peak rss + 3 tiers)
    assert mem["b.log: host states"] == [2.0, 2.25] and mem["a.log: nvme states"] == [3.0, 3.0, 2.5]

    out = tmp_path / "run.png"
    dpi = 40
    render(runs, str(out), dpi)
    pixels = mpimg.imread(str(out))
    assert pixels.shape[:2] == (round(FIG_INCHES[1] * dpi), round(FIG_INCHES[0] * dpi))
    assert pixels.std() > 0.01  # something was drawn

    main([str(a), str(b), "-o", str(tmp_path / "cli.png"), "--dpi", "30"])
    assert mpimg.imread(str(tmp_path / "cli.png")).shape[:2] == (300, 300)


def test_summary_is_steady_state_means_and_memory_peaks(monkeypatch, tmp_path, capsys):
    path = tmp_path / "a.log"
    _trainer_log(monkeypatch, RUN_A, path)
    main([str(path), "--summary"])
    s = json.loads(capsys.readouterr().out)
    assert (s["intervals"], s["first_iteration"], s["last_iteration"]) == (3, 4, 12)
    assert s["step_time_s"] == pytest.approx((0.25 + 0.125) / 2)  # the first (warm-up) interval is left out
    assert s["tokens_per_s"] == pytest.approx((GBS * SEQ / 0.25 + GBS * SEQ / 0.125) / 2)
    assert s["lm_loss_first"] == pytest.approx(3.4375, rel=1e-6)
    assert s["peak_memory_gib"]["host states"] == 1.5 and s["peak_memory_gib"]["nvme states"] == 3.0
    assert math.isfinite(s["tflops"])


def test_log_without_training_lines_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "garbage.log"
    path.write_text("Traceback (most recent call last):\n  iteration went wrong | lm loss: x\nhello\n")
    with pytest.raises(LogParseError, match=r"garbage\.log: no training log lines found"):
        parse_log(str(path))
    with pytest.raises(SystemExit) as exc:
        main([str(path), "-o", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and "captured stdout of pretrain_gpt.py" in err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(LogParseError, match=r"missing\.log: cannot read the log"):
        parse_log(str(tmp_path / "missing.log"))
