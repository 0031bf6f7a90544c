"""Plot a training run from its log: step time, memory per tier and lm loss against the iteration.

    python tools/plot_run.py run.log [other.log ...] -o run.png
    python tools/plot_run.py run.log --summary          # one JSON object per log (no plot)

Reads the captured stdout of pretrain_gpt.py / examples/start.sh: the per-interval lines that
``megatron/training/train_log.py`` prints (``iteration N/ M | key: value | ... | mem (GiB) a: x, b: y | ...``),
with or without a launcher's ``[rank3]:`` prefix. Any other line (evaluation, start-up, comm summaries)
is skipped. Several logs are overlaid, labelled with their file names.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.tool_errors import one_line_errors  # noqa: E402

# "iteration       10/     100 | key: value | ..." anywhere in the line (launcher prefixes come before it).
_LINE = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)$")
_MEM_PREFIX = "mem (GiB) "
STEP_TIME_KEY = "elapsed time per iteration (ms)"
FIG_INCHES = (10.0, 10.0)


class LogParseError(ValueError):
    """A log that cannot be plotted; the message names the file and what was expected."""


@dataclass
class RunLog:
    """The series of one log, one entry per logged interval (NaN where a line lacks the field)."""
    path: str
    iterations: list[int] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    lm_loss: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    tflops: list[float] = field(default_factory=list)
    memory_gib: dict[str, list[float]] = field(default_factory=dict)  # field name (e.g. "host states") -> GiB


def _fields(rest: str) -> tuple[dict[str, str], dict[str, float]]:
    """``key: value`` pairs of one line, and its memory group split into name -> GiB."""
    values, memory = {}, {}
    for part in rest.split("|"):
        part = part.strip()
        if part.startswith(_MEM_PREFIX):
            for item in part[len(_MEM_PREFIX):].split(","):
                name, _, number = item.rpartition(":")
                if name:
                    memory[name.strip()] = float(number)
        else:
            key, sep, value = part.partition(": ")
            if sep:
                values[key.strip()] = value.strip()
    return values, memory


def _number(values: dict[str, str], key: str) -> float:
    return float(values[key]) if key in values else math.nan


def parse_log(path: str) -> RunLog:
    """Every training-interval line of ``path``; LogParseError when there is none."""
    run = RunLog(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                m = _LINE.search(line)
                if m is None:
                    continue
                try:
                    values, memory = _fields(m.group(2))
                    if STEP_TIME_KEY not in values:
                        continue
                    numbers = (int(m.group(1)), float(values[STEP_TIME_KEY]) / 1000.0, _number(values, "lm loss"),
                               _number(values, "tokens per second"), _number(values, "TFLOPs"))
                except ValueError as e:
                    raise LogParseError(f"{path} line {lineno}: a field is not a number ({e}); the log is damaged "
                                        f"or not pretrain_gpt.py's: fix or drop that line") from None
                n = len(run.iterations)
                for series, number in zip((run.iterations, run.step_time_s, run.lm_loss, run.tokens_per_s,
                                           run.tflops), numbers):
                    series.append(number)
                for name in memory.keys() - run.memory_gib.keys():  # a field first seen now: NaN before
                    run.memory_gib[name] = [math.nan] * n
                for name, series in run.memory_gib.items():
                    series.append(memory.get(name, math.nan))
    except OSError as e:
        raise LogParseError(f"{path}: cannot read the log ({e.strerror})") from None
    if not run.iterations:
        raise LogParseError(f"{path}: no training log lines found (expected lines like 'iteration 10/ 100 | ... | "
                            f"{STEP_TIME_KEY}: 123.4 | ...'); pass the captured stdout of pretrain_gpt.py or "
                            f"examples/start.sh, with --log-interval smaller than --train-iters")
    return run


def summary(run: RunLog) -> dict:
    """Steady-state figures: means over the intervals after the first (warm-up), peaks of the memory fields."""
    steady = slice(1, None) if len(run.iterations) > 1 else slice(None)

    def mean(xs: list[float]) -> float:
        finite = [x for x in xs[steady] if math.isfinite(x)]
        return sum(finite) / len(finite) if finite else math.nan

    return {"file": run.path, "intervals": len(run.iterations), "first_iteration": run.iterations[0],
            "last_iteration": run.iterations[-1], "step_time_s": mean(run.step_time_s),
            "tokens_per_s": mean(run.tokens_per_s), "tflops": mean(run.tflops),
            "lm_loss_first": run.lm_loss[0], "lm_loss_last": run.lm_loss[-1],
            "peak_memory_gib": {k: max((x for x in v if math.isfinite(x)), default=math.nan)
                                for k, v in run.memory_gib.items()}}


def _labels(runs: list[RunLog]) -> list[str]:
    names = [os.path.basename(r.path) for r in runs]
    return names if len(set(names)) == len(names) else [r.path for r in runs]  # same names: show the paths


def build_figure(runs: list[RunLog]):
    """Three panels sharing the iteration axis: step time (s), memory per field (GiB), lm loss."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, no pyplot: no GUI, no global figures
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIG_INCHES, layout="constrained")
    FigureCanvasAgg(fig)
    step_ax, mem_ax, loss_ax = fig.subplots(3, 1, sharex=True)
    styles = ["-", "--", ":", "-."]
    style_of = {name: styles[j % len(styles)]  # one line style per memory field, one colour per log
                for j, name in enumerate(sorted({n for r in runs for n in r.memory_gib}))}
    for k, (run, label) in enumerate(zip(runs, _labels(runs))):
        color = f"C{k % 10}"
        step_ax.plot(run.iterations, run.step_time_s, color=color, marker=".", label=label)
        loss_ax.plot(run.iterations, run.lm_loss, color=color, marker=".", label=label)
        for name, series in sorted(run.memory_gib.items()):
            mem_ax.plot(run.iterations, series, color=color, linestyle=style_of[name], marker=".",
                        label=f"{label}: {name}")
    step_ax.set_ylabel("step time (s)")
    mem_ax.set_ylabel("memory (GiB)")
    loss_ax.set_ylabel("lm loss")
    loss_ax.set_xlabel("iteration")
    for ax in (step_ax, mem_ax, loss_ax):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes
    if not mem_ax.lines:
        mem_ax.text(0.5, 0.5, "no memory fields in the log", transform=mem_ax.transAxes, ha="center")
    return fig


def render(runs: list[RunLog], out: str, dpi: int) -> None:
    """Write the figure as a PNG of FIG_INCHES x dpi pixels."""
    build_figure(runs).savefig(out, dpi=dpi, format="png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", help="captured stdout of pretrain_gpt.py / examples/start.sh")
    parser.add_argument("-o", "--output", default="run.png", help="PNG to write (default: run.png)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch of the 10x10 in figure")
    parser.add_argument("--summary", action="store_true",
                        help="print one JSON line per log (steady-state step time, tokens/s, TFLOP/s, "
                             "memory peaks) instead of plotting")
    args = parser.parse_args(argv)
    if args.dpi <= 0:
        parser.error(f"--dpi must be > 0 (got {args.dpi})")
    with one_line_errors("plot_run.py", "give -o a path in a writable directory"):
        runs = [parse_log(p) for p in args.logs]
        if args.summary:
            for run in runs:
                print(json.dumps(summary(run)))
            return
        render(runs, args.output, args.dpi)
    print(f"wrote {args.output} ({len(runs)} log(s), {sum(len(r.iterations) for r in runs)} intervals)")


if __name__ == "__main__":
    main()
