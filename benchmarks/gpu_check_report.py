"""gpu_check.sh's record: one JSON state, re-rendered as a markdown summary after every stage.

    python3 -m benchmarks.gpu_check_report --state S.json --summary S.md --logs L.txt init --budget 465 ...
    python3 -m benchmarks.gpu_check_report ... stage --name dense --title "3 dense" --rc 0 --seconds 98 --cap 140 \
        --result dense.json --log dense.log
    python3 -m benchmarks.gpu_check_report ... note "text"
    python3 -m benchmarks.gpu_check_report ... machine machine.txt      # key=value lines about the machine

Standard library only (matmul_peak imports torch only to measure), so the record is still written when torch is
what fails. ``stage`` adds the stage's row (status from its exit code, seconds against its cap, its figures or its
telling error line), appends the tail of its log to --logs, and rewrites --summary: the machine, the measured
matmul peak, the stage table, pytest's result per test (read from its -v lines, so a run cut before its totals
still has them), each comparison's table with ours / peer ratios and the planner's predicted step against the
measured one, the planned against measured memory of the largest model, the last lines of every failed or
incomplete job's log, notes. Every row has figures or says why it has none. The summary is the section to
paste into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

from benchmarks.matmul_peak import DATASHEET_TFLOPS
from benchmarks.one_line_args import OneLineParser

LOG_TAIL_LINES = 120
ERROR_MARKERS = re.compile(r"Error|error:|Traceback|Killed|out of memory|FAILED|Timeout|timed out|not found")
OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# pytest -v: "tests/x.py::test_a PASSED [ 4%]"; under xdist: "[gw1] [  4%] PASSED tests/x.py::test_a".
_WORD = "|".join(OUTCOMES)
_VERBOSE = re.compile(rf"^(?:\[gw\d+\] \[\s*\d+%\] ({_WORD}) (\S+::\S+)|(\S+::\S+) ({_WORD})\b)")
_COLLECTED = re.compile(r"collected (\d+) items?|\d+ workers? \[(\d+) items?\]")


def _load(path: str | None) -> dict | None:
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _lines(path: str | None) -> list[str]:
    if not path or not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [ln.rstrip("\n") for ln in f]


def last_error(log: str | None) -> str:
    """The most telling line of a failed stage's log: the last error-like one, else its last line."""
    lines = [ln.strip() for ln in _lines(log) if ln.strip()]
    hits = [ln for ln in lines if ERROR_MARKERS.search(ln)]
    return (hits[-1] if hits else lines[-1] if lines else "(no output)")[:200]


def status_of(rc: int) -> str:
    return {0: "PASS", 124: "TIMEOUT", 137: "TIMEOUT"}.get(rc, f"FAIL(rc={rc})")


def read_machine(path: str | None) -> dict:
    """key=value lines (gpu_check.sh's preflight)."""
    out = {}
    for ln in _lines(path):
        key, sep, value = ln.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _params(n: int | None) -> str:
    return "?" if not n else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# ---- figures of each kind of stage --------------------------------------------------------------------------
def test_outcomes(log: str | None) -> tuple[dict[str, str], int | None]:
    """Each test's outcome from pytest's -v lines (the last word on a test wins: a teardown error follows its
    PASSED), and the number collected."""
    outcomes, collected = {}, None
    for ln in _lines(log):
        m = _VERBOSE.match(ln.strip())
        if m:
            outcome, node = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            outcomes[node] = outcome if outcomes.get(node) not in ("FAILED", "ERROR") else outcomes[node]
        c = _COLLECTED.search(ln)
        if c:
            collected = int(c.group(1) or c.group(2))
    return outcomes, collected


def tests_figures(log: str | None) -> tuple[str, str | None, dict]:
    """pytest's counts from its per-test lines (a run cut before its totals line still has them), the first
    failures, and each test's outcome; SKIPPED when nothing ran (no GPU seen)."""
    outcomes, collected = test_outcomes(log)
    counts = {o: sum(1 for x in outcomes.values() if x == o) for o in OUTCOMES}
    result = ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n)
    totals = [ln.strip("= ").strip() for ln in _lines(log)
              if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln) and " in " in ln]
    if not outcomes and totals:
        result = totals[-1]
    if collected is not None:
        result = f"{result or 'no test finished'} of {collected} collected"
        if len(outcomes) < collected:
            result += f"; {collected - len(outcomes)} not finished (cut)" if not totals else ""
    failed = [n for n, o in outcomes.items() if o in ("FAILED", "ERROR")]
    if failed:
        result += f"; failed: {failed[0]}" + (f" (+{len(failed) - 1} more)" if len(failed) > 1 else "")
    ran = counts["PASSED"] + counts["FAILED"] + counts["ERROR"] + counts["XPASS"] + counts["XFAIL"]
    skipped = not ran and (counts["SKIPPED"] > 0 or "skipped" in result)
    return result, "SKIPPED" if skipped else None, {"tests": outcomes, "collected": collected}


def peak_figures(peak: dict | None, machine: dict) -> str:
    parts = []
    if peak:
        parts.append(f"{peak.get('dtype', 'bf16')} {peak['size']}^3 matmul: median {_tf(peak['median_tflops'])} "
                     f"TFLOP/s (min {_tf(peak['min_tflops'])}, max {_tf(peak['max_tflops'])}; {peak['samples']} x "
                     f"{peak['per_sample']}{_timed(peak)}), {peak['median_tflops'] / DATASHEET_TFLOPS:.0%} of the "
                     f"{DATASHEET_TFLOPS:g} datasheet")
    if machine.get("disk_write"):
        parts.append(f"disk write {machine['disk_write']} ({machine.get('disk_write_where', '?')})")
    return "; ".join(parts)


def _tf(x: float) -> str:
    """TFLOP/s: whole numbers on a GPU, three figures on a CPU (a rehearsal's fractions of one)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _timed(peak: dict) -> str:
    return f", {peak['seconds']:.1f} s after {peak['warmup_s']:g} s of warm-up" if "seconds" in peak else ""


def _short(key: str) -> str:
    return {"ours-trainer": "ours (trainer)", "ours": "ours (worker)", "fsdp2": "FSDP2", "megatron": "Megatron",
            "deepspeed": "DeepSpeed", "ddp": "DDP", "ours-offload": "ours+offload", "fsdp2-offload": "FSDP2+offload",
            "deepspeed-offload": "DeepSpeed+offload", "ours-trainer-offload": "ours (trainer)+offload"}.get(key, key)


def peers_figures(res: dict | None) -> tuple[str, str | None]:
    """One line: tokens/s and MFU per system, the ours / peer ratios, the loss check, copy overlap."""
    if not res:
        return "", None  # the log's error line tells why
    figs, parts = res.get("figures", {}), []
    for r in res.get("results", []):
        f = figs.get(r["key"])
        if f:
            mfu = f" (MFU {f['mfu']:.0%})" if f.get("mfu") else ""
            hidden = f", {r['overlap']['hidden']:.0%} of copies hidden" if (r.get("overlap") or {}).get("copies") \
                else ""
            parts.append(f"{_short(r['key'])} {f['tokens_per_s']:,.0f} tok/s{mfu}{hidden}")
        elif r["status"] == "incomplete":
            steps = r.get("step_s") or []
            parts.append(f"{_short(r['key'])} incomplete ({len(steps)} step(s) done"
                         f"{': ' + ', '.join(f'{x:.2f}' for x in steps[:4]) + ' s' if steps else ''})")
        elif r["status"] != "not installed":
            parts.append(f"{_short(r['key'])} {r['status']}")
    parts += [f"{_short(x['ours'])} / {_short(x['peer'])} {x['ratio']:.2f}x" for x in res.get("ratios", [])]
    diffs = [f["loss_diff"] for f in figs.values() if f.get("loss_diff") is not None]
    if diffs:
        ok = max(diffs) <= res.get("loss_rtol", 0)
        parts.append(f"losses {'agree' if ok else 'DIFFER'} (max {max(diffs):.1e} vs {res.get('reference')})")
    ours = [(k, f) for k, f in figs.items() if k.startswith("ours") and f.get("predicted_over_measured")]
    if ours:
        parts.append("planner predicted / measured: " + ", ".join(
            f"{_short(k)} {f['predicted_step_s']:.2f} / {f['median_step_s']:.2f} s" for k, f in ours))
    failed = [r for r in res.get("results", []) if r["status"] in ("failed", "incomplete")]
    return "; ".join(parts), (f"{failed[0]['key']}: {failed[0]['error']}"[:200] if failed else None)


def maxscale_figures(res: dict | None) -> tuple[str, str | None]:
    if not res:
        return "", None  # the log's error line tells why
    parts = []
    w = res.get("whole_machine") or {}
    if w.get("largest_layers"):
        parts.append(f"whole machine (planned): {w['largest_layers']} layers, {_params(w['largest_parameters'])}, "
                     f"offload {w['offload']}, predicted {w['predicted_step_s'] or 0:.0f} s/step")
    t, run = res.get("trained_plan") or {}, res.get("run") or {}
    if t:
        parts.append(f"trained: {t['layers']} layers, {_params(t['parameters'])}, offload {t['offload']}")
    if run.get("step_s"):
        parts.append(f"{run['step_s']:.2f} s/step ({len(run['steps'])} steps; planner predicted "
                     f"{_s(t.get('predicted_step_s'))}{predicted_note(res)})")
    elif run.get("status") == "incomplete":
        parts.append(f"incomplete: {len(run.get('steps', []))} step(s) done")
    states = run.get("states_gib") or {}
    if states:
        parts.append("engine's states GiB: " + ", ".join(f"{k} {states[k]:.2f}" for k in ("device", "host", "nvme")
                                                         if k in states))
    peaks = run.get("peak_gib", {})
    if peaks:
        parts.append("peak GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(peaks.items())) +
                     f", page files {run.get('disk_peak_gib', 0):.1f}")
    err = res.get("error") or run.get("error")
    return "; ".join(parts), err


def predicted_note(res: dict) -> str:
    t = res.get("trained_plan") or {}
    if t.get("predicted_step_s") is None:
        return " (the planner predicts accelerator steps only)" if res.get("device") == "cpu" else ""
    run = res.get("run") or {}
    ratio = f", {t['predicted_step_s'] / run['step_s']:.2f} of measured" if run.get("step_s") else ""
    return f" at {res['peak_tflops']:.0f} TFLOP/s measured{ratio}" if res.get("peak_tflops") else ratio


# ---- the summary ---------------------------------------------------------------------------------------------
def machine_line(state: dict) -> str:
    m, peak = state.get("machine", {}), (state.get("peak") or {}).get("machine", {})
    gpu = m.get("gpu_name") or peak.get("device") or "no GPU seen"
    mem = m.get("gpu_memory") or (f"{peak['device_memory_gib']} GiB" if peak.get("device_memory_gib") else "")
    cuda = f" (CUDA {peak['cuda']})" if peak.get("cuda") else ""
    parts = [f"{gpu}" + (f" ({mem})" if mem else ""), f"driver {m.get('driver', '?')}",
             f"torch {peak.get('torch') or m.get('torch', '?')}{cuda}",
             f"python {peak.get('python') or m.get('python', '?')}", f"{m.get('cores', '?')} cores",
             f"{m.get('ram_total_gib', '?')} GiB RAM ({m.get('ram_available_gib', '?')} available)"]
    return ", ".join(parts)


def render(state: dict) -> str:
    peak = state.get("peak")
    spent = sum(s["seconds"] for s in state["stages"])
    out = [f"### GPU check, {state['started'][:10]}: {machine_line(state)}", "",
           f"Command: `{state.get('command', 'bash benchmarks/gpu_check.sh')}` (started {state['started']}; stage caps "
           f"{state['budget_s']} s in all, under the {state.get('limit_s', 540)} s limit; {spent} s so far).", ""]
    if peak:
        out += [f"Measured {peak.get('dtype', 'bf16')} matmul peak (MFU is taken against it): "
                f"**{_tf(peak['median_tflops'])} TFLOP/s**, the median of {peak['samples']} groups of "
                f"{peak['per_sample']} {peak['size']}^3 matmuls{_timed(peak) or ' after warm-up'} (min "
                f"{_tf(peak['min_tflops'])}, max {_tf(peak['max_tflops'])}); the datasheet's "
                f"{DATASHEET_TFLOPS:g} is the second MFU column ({peak['median_tflops'] / DATASHEET_TFLOPS:.0%} "
                f"of it).", ""]
    out += ["| stage | status | seconds (cap) | figures |", "|---|---|---:|---|"]
    for s in state["stages"]:
        fig = s["figures"] or ""
        if s.get("error") and s["status"] != "PASS":
            fig = f"{s['error']}" + (f" / {fig}" if fig else "")
        elif s.get("error"):
            fig += f" (note: {s['error']})"
        fig = fig or "(no figures: see logs.txt)"
        out.append(f"| {s['title']} | {s['status']} | {s['seconds']} ({s['cap']}) | {fig.replace('|', '/')} |")
    for s in state["stages"]:
        res = s.get("result")
        if s["kind"] == "tests" and res and res.get("tests"):
            out += ["", f"#### {s['title']}", "", "| test | outcome |", "|---|---|"]
            out += [f"| {node} | {outcome} |" for node, outcome in res["tests"].items()]
        if s["kind"] == "peers" and res and res.get("table"):
            out += ["", f"#### {s['title']}", "", res.get("header", ""), "", *res["table"]]
        if s["kind"] == "maxscale" and res:
            out += ["", f"#### {s['title']}", "", *maxscale_section(res)]
    tails = [(f"{s['title']} / {name}", tail) for s in state["stages"] for name, tail in job_tails(s.get("result"))]
    if tails:
        out += ["", "#### Failed or incomplete jobs: the last lines of their logs"]
        for name, tail in tails:
            out += ["", f"{name}:", "", "```", *tail, "```"]
    notes = state.get("notes", [])
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def maxscale_section(res: dict) -> list[str]:
    sc, host, t = res.get("scratch") or {}, res.get("host") or {}, res.get("trained_plan") or {}
    lines = []
    if sc:
        lines.append(f"SSD tier in `{sc['path']}` ({sc['fstype']}, {sc.get('free_gib', 0):.0f} GiB free): "
                     f"{sc['why']}; `{sc['tmp']}` is {sc['tmp_fstype']}.")
    if host:
        lines.append(f"Host memory told to the whole-machine plan: {host['fraction']:g} x {host['available_gib']:.0f} "
                     f"GiB available = {host['planned_gib']:.0f} GiB (the planner gives states 90% of what it is "
                     f"told and has no flag for that share).")
    w = res.get("whole_machine") or {}
    if w.get("message"):
        lines.append(f"Whole machine, planned only: {w['message']} (predicted {_s(w.get('predicted_step_s'))} "
                     f"s/step).")
    sl = res.get("slice") or {}
    if t:
        where = ", ".join(f"{k.split('_')[0]} {v:g} GiB" for k, v in sl.items() if v is not None)
        lines.append(f"Trained, 3 steps, with the planner's config for a slice of the machine ({where}) so that it "
                     f"fits the time: {t['message']}.")
    run = res.get("run") or {}
    if t.get("need_gib"):
        peaks = run.get("peak_gib", {})
        measured = {"device": [f"{k} {peaks[k]:.2f}" for k in ("cuda max alloc", "device states") if k in peaks],
                    "host": [f"{k} {peaks[k]:.2f}" for k in ("peak rss", "host states") if k in peaks],
                    "nvme": [f"nvme states {peaks['nvme states']:.2f}"] if "nvme states" in peaks else []}
        if "disk_peak_gib" in run:
            measured["nvme"].append(f"page files {run['disk_peak_gib']:.2f}")
        lines += ["", "| tier | planned need (GiB) | measured peak (GiB) |", "|---|---:|---|"]
        lines += [f"| {tier} | {need:.2f} | {', '.join(measured.get(tier, [])) or '-'} |"
                  for tier, need in t["need_gib"].items()]
    if run.get("steps"):
        lines += ["", f"s/step {', '.join(f'{x:.2f}' for x in run['steps'])} (median after the first "
                      f"{run['step_s']:.2f}; planned {_s(t.get('predicted_step_s'))}); losses "
                      f"{', '.join(f'{x:.4f}' for x in run['losses'])}."]
    return lines


def job_tails(res: dict | None) -> list[tuple[str, list[str]]]:
    """(job, its log's last lines) of each failed or incomplete job of a stage's result."""
    if not res:
        return []
    tails = [(r["key"], r["log_tail"]) for r in res.get("results", []) if r.get("log_tail")]
    run = res.get("run") or {}
    if run.get("log_tail"):
        tails.append(("training run", run["log_tail"]))
    return tails


def stage_row(a: argparse.Namespace, state: dict) -> dict:
    """A stage's row: its status, its figures (from its result file or its log) and its telling error line."""
    kind = "peers" if a.name in ("dense", "offload") else a.name  # what the figures are read from
    row = {"name": a.name, "title": a.title, "kind": kind, "status": a.status or status_of(a.rc), "rc": a.rc,
           "seconds": a.seconds, "cap": a.cap, "figures": a.figures, "error": None, "result": None, "log": a.log}
    if a.status:  # a stage that did not run: its figures say why
        return row
    if kind == "preflight":
        state["peak"] = _load(a.result)
        row["figures"] = peak_figures(state["peak"], state["machine"]) or a.figures
    elif kind == "tests":
        row["figures"], skipped, row["result"] = tests_figures(a.log)
        if skipped and a.rc == 0:
            row["status"] = skipped
    elif kind in ("peers", "maxscale"):
        row["result"] = _load(a.result)
        row["figures"], row["error"] = (peers_figures if kind == "peers" else maxscale_figures)(row["result"])
    if a.rc != 0 and not row["error"]:
        row["error"] = last_error(a.log)
    elif kind in ("peers", "maxscale") and row["result"] is None:
        row["error"] = "no results written"
    return row


def save(state: dict, a: argparse.Namespace) -> None:
    with open(a.state, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
    with open(a.summary, "w", encoding="utf-8") as f:
        f.write(render(state))


def append_log(a: argparse.Namespace, title: str, rc: int, log: str | None, result: dict | None = None) -> None:
    """The stage log's tail, then each failed or incomplete job's (its traceback is in its own log)."""
    if not a.logs or not log:
        return
    lines = _lines(log)
    with open(a.logs, "a", encoding="utf-8") as f:
        f.write(f"\n===== {title}: exit {rc}; last {min(len(lines), LOG_TAIL_LINES)} of {len(lines)} lines of "
                f"{log} =====\n")
        f.write("\n".join(lines[-LOG_TAIL_LINES:]) + "\n")
        for name, tail in job_tails(result):
            f.write(f"\n===== {title} / {name}: its log's last {len(tail)} lines =====\n" + "\n".join(tail) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python3 -m benchmarks.gpu_check_report", description=__doc__.splitlines()[0])
    p.add_argument("--state", required=True, help="the JSON record (read, updated, rewritten)")
    p.add_argument("--summary", required=True, help="the markdown summary (rewritten)")
    p.add_argument("--logs", help="stage log tails are appended here")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("--budget", type=int, required=True)
    i.add_argument("--limit", type=int, default=540, help="the seconds the whole check may run")
    i.add_argument("--command", default="bash benchmarks/gpu_check.sh")
    s = sub.add_parser("stage")
    s.add_argument("--name", required=True, help="the stage (dense and offload read a gpu_peers result)")
    s.add_argument("--title", required=True)
    s.add_argument("--rc", type=int, required=True)
    s.add_argument("--seconds", type=int, required=True)
    s.add_argument("--cap", type=int, required=True)
    s.add_argument("--log")
    s.add_argument("--result", help="the stage's JSON (matmul_peak, gpu_peers or gpu_max_scale)")
    s.add_argument("--figures", default="", help="the figures, for a stage with no result file")
    s.add_argument("--status", help="the row's status instead of the exit code's (e.g. SKIPPED)")
    n = sub.add_parser("note")
    n.add_argument("text")
    m = sub.add_parser("machine", help="merge key=value lines about the machine into the record")
    m.add_argument("file")
    a = p.parse_args(argv)

    if a.cmd == "init":
        state = {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "budget_s": a.budget, "limit_s": a.limit, "command": a.command, "stages": [], "notes": [],
                 "machine": {}, "peak": None}
        save(state, a)
        if a.logs:
            open(a.logs, "w", encoding="utf-8").close()  # a reused OUT starts a new log file
        return 0
    state = _load(a.state)
    if state is None:
        print(f"gpu_check_report: error: no state at {a.state}; run `init` first", file=sys.stderr)
        return 2
    if a.cmd == "note":
        state["notes"].append(a.text)
        save(state, a)
        return 0
    if a.cmd == "machine":
        state["machine"].update(read_machine(a.file))
        save(state, a)
        return 0
    row = stage_row(a, state)
    state["stages"] = [x for x in state["stages"] if x["name"] != a.name] + [row]
    save(state, a)
    append_log(a, a.title, a.rc, a.log, row["result"] if row["kind"] != "tests" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
