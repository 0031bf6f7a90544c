"""The planner's largest GPT of a family on one GPU + host + disk, and 3 training steps of it in bounded time
(gpu_check.sh stage 5): planned against measured memory per tier.

    python -m benchmarks.gpu_max_scale --json maxscale.json
    python -m benchmarks.gpu_max_scale --device cpu --family 128,4,512 --seq 64 --layers 2 --slice-host-gib 2 \
        --no-whole-machine

1. The scratch folder of the SSD tier: --nvme-path, else the first disk-backed one of benchmarks/logs/ (the
   repository's disk), /var/tmp and the temporary folder. A folder on tmpfs or ramfs is memory, not disk:
   it is refused unless named with --nvme-path (and then reported as such).
2. The plan for the whole machine (device memory detected, host memory = --host-fraction x available, disk =
   free space under the scratch folder): ``tools/plan_memory.py --largest --json``, planning only. The planner
   gives states 90% of the host memory it is told about and has no flag for that share; telling it a smaller
   host memory is how pinned buffers are kept from pushing the machine out of memory.
3. The trained run: the planner's --largest for a slice of the machine (--slice-device-gib, --slice-host-gib,
   --slice-disk-gib; its config puts budgets per tier in the JSON), or its config for --layers N, with the
   states offloaded as --offload says (default nvme: the optimizer's sub-groups that are not kept on the device
   live on SSD, so all three tiers hold states), trained 3 steps with ``pretrain_gpt.py --deepspeed`` under
   --budget-s. The whole machine's largest is far slower (its SSD traffic and a model build of billions of
   parameters take minutes), so it is planned, not trained. The planner's step prediction is at the measured
   matmul peak (--peak-json) where there is one.
4. Measured: s/step, each tier's peak from the trainer's log (GPU max allocated, host RSS, the engine's own
   report of the bytes of states it holds per tier), the page files' peak disk space; against the plan's need
   per tier. A run whose plan puts states on SSD but whose engine reports none there fails: the SSD tier is
   what this stage checks.
The JSON (--json) is written after each step of this list, so a cut run keeps what it did.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import psutil

from benchmarks.one_line_args import OneLineParser
from benchmarks.peer_workers.harness import (
    LOGS_DIR,
    Terminated,
    cut_reason,
    first_error,
    log_tail,
    mock_trainer_flags,
    raise_on_sigterm,
    run_job,
    terminated,
    torchrun,
)
from zero_cache.aio import nearest_existing_dir

MEMORY_FS = ("tmpfs", "ramfs")
GiB = 2**30


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (the longest mount point that contains it)."""
    path = os.path.realpath(path)
    mounts = [m for m in psutil.disk_partitions(all=True)
              if path == m.mountpoint or path.startswith(m.mountpoint.rstrip("/") + "/")]
    return max(mounts, key=lambda m: len(m.mountpoint)).fstype if mounts else "unknown"


def choose_scratch(given: str | None) -> dict:
    """Where the SSD tier's page files go, and why there."""
    tmp = tempfile.gettempdir()
    tmp_kind = fs_type(tmp)
    if given:
        kind = fs_type(nearest_existing_dir(given))
        why = "given with --nvme-path" + (f"; {kind} is memory, not disk" if kind in MEMORY_FS else "")
        return {"path": given, "fstype": kind, "why": why, "tmp": tmp, "tmp_fstype": tmp_kind}
    candidates = [os.path.join(LOGS_DIR, "gpu_max_scale-nvme"), "/var/tmp/zc_gpu_max_scale",
                  os.path.join(tmp, "zc_gpu_max_scale")]
    for path in candidates:
        kind = fs_type(nearest_existing_dir(path))
        if kind not in MEMORY_FS:
            why = (f"the first disk-backed candidate ({kind}); {tmp} is {tmp_kind}" if tmp_kind in MEMORY_FS else
                   f"the repository's disk ({kind}), where benchmarks/logs/ lives" if path == candidates[0] else
                   f"the first disk-backed candidate ({kind})")
            return {"path": path, "fstype": kind, "why": why, "tmp": tmp, "tmp_fstype": tmp_kind}
    raise RuntimeError(f"no disk-backed scratch folder among {', '.join(candidates)} (all on "
                       f"{'/'.join(MEMORY_FS)}); give one with --nvme-path")


def plan(argv: list[str]) -> tuple[int, dict | None, str]:
    """tools/plan_memory.py in this process (one torch import for both plans): exit code, JSON, text."""
    from ptm_planner.cli import main as planner

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = planner(argv + ["--json"])
    try:
        return rc, json.loads(out.getvalue()), err.getvalue().strip()
    except ValueError:
        return rc, None, (err.getvalue() or out.getvalue()).strip()


def plan_summary(p: dict) -> dict:
    """What a plan says, in the figures the report shows."""
    step = p.get("step_prediction") or {}
    return {"fits": p["fits"], "layers": p["model"]["num_layers"], "parameters": p["model"]["num_parameters"],
            "largest_layers": p.get("largest_layers"), "largest_parameters": p.get("largest_parameters"),
            "offload": p["option"]["offload"], "micro_batch": p["option"]["micro_batch_size"],
            "recompute": p["option"]["recompute"], "predicted_step_s": step.get("step_s"),
            "need_gib": {t: n / GiB for t, n in p["stages"][0]["need"].items()} if p["stages"] else {},
            "hardware": p["hardware"], "message": p["message"].splitlines()[0]}


def folder_bytes(path: str) -> int:
    """Disk space the files under ``path`` take (allocated blocks: sparse page files count what they use)."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:  # removed while we looked
                pass
    return total


class DiskMonitor:
    """Peak disk space of the SSD tier's page files, sampled twice a second (the folder, not the whole file
    system: other writers on a shared disk do not count)."""

    def __init__(self, path: str):
        self.path, self.peak = path, folder_bytes(path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, folder_bytes(self.path))

    def stop(self) -> float:
        """The peak, GiB."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, folder_bytes(self.path)) / GiB


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m benchmarks.gpu_max_scale", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--family", default="4096,32,16384", help="hidden,heads,ffn (default: the 6.7b shape)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000, help="NullTokenizer vocabulary (the model pads + eod)")
    p.add_argument("--layers", type=int, help="train this many layers with the planner's config (no --largest)")
    p.add_argument("--slice-device-gib", type=float, default=16.0, help="GPU memory the trained run is planned for")
    p.add_argument("--slice-host-gib", type=float, default=6.0, help="host memory the trained run is planned for")
    p.add_argument("--slice-disk-gib", type=float, default=8.0, help="free disk the trained run is planned for")
    p.add_argument("--offload", choices=["auto", "none", "cpu", "cpu+nvme", "nvme"], default="nvme",
                   help="the trained run's offload (default nvme: states on all three tiers; auto: the planner's "
                        "fastest that fits)")
    p.add_argument("--device-rate", type=float,
                   help="the share of optimizer sub-groups kept on the device tier, instead of the planner's "
                        "prefetch_cache_sub_group_rate (on a CPU the planner keeps them all there, in host RAM: the "
                        "CPU rehearsal gives 0 so that the SSD tier holds states)")
    p.add_argument("--peak-json", help="benchmarks.matmul_peak --json output: the planner predicts steps at its "
                                       "median TFLOP/s")
    p.add_argument("--host-fraction", type=float, default=0.6,
                   help="share of available host memory the whole-machine plan is told about (default 0.6)")
    p.add_argument("--no-whole-machine", action="store_true",
                   help="skip the whole-machine plan (a tiny family's largest on a CPU is millions of layers)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme-path", help="scratch folder of the SSD tier (default: see above)")
    p.add_argument("--budget-s", type=float, default=600, help="seconds for everything: the plans, then the training "
                                                              "run gets what is left")
    p.add_argument("--keep-pages", action="store_true", help="leave the SSD page files in the scratch folder")
    p.add_argument("--json", help="write the figures here (after each step)")
    p.add_argument("--log", help="the training log (default: next to --json, else under benchmarks/logs/)")
    a = p.parse_args(argv)
    try:
        a.hidden, a.heads, a.ffn = (int(x) for x in a.family.split(","))
    except ValueError:
        p.error(f"--family takes hidden,heads,ffn as three integers, got {a.family!r}")
    if a.device_rate is not None and not 0 <= a.device_rate <= 1:
        p.error(f"--device-rate must be in [0, 1], got {a.device_rate}")
    if not 0 < a.host_fraction <= 0.9:
        p.error(f"--host-fraction must be in (0, 0.9], got {a.host_fraction}")
    if a.steps < 1 or (a.layers is not None and a.layers < 1):
        p.error("--steps and --layers must be >= 1")
    a.peak_tflops = None
    if a.peak_json:
        try:
            with open(a.peak_json, encoding="utf-8") as f:
                a.peak_tflops = float(json.load(f)["median_tflops"])
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--peak-json {a.peak_json}: no median_tflops there ({e})")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    deadline = time.monotonic() + a.budget_s
    out: dict = {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "device": a.device,
                 "family": {"hidden": a.hidden, "heads": a.heads, "ffn": a.ffn, "seq": a.seq, "vocab": a.vocab},
                 "status": "running", "notes": []}

    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)

    def save() -> None:
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)

    raise_on_sigterm()
    try:
        try:
            scratch = choose_scratch(a.nvme_path)
        except RuntimeError as e:
            out.update(status="failed", error=str(e))
            save()
            print(f"gpu_max_scale: error: {e}", file=sys.stderr)
            return 2
        nvme = os.path.join(scratch["path"], "zc_pages")  # only this sub-folder is ever removed
        os.makedirs(nvme, exist_ok=True)
        usage = psutil.disk_usage(nvme)
        scratch.update(free_gib=usage.free / GiB, total_gib=usage.total / GiB)
        out["scratch"] = scratch
        avail = psutil.virtual_memory().available
        out["host"] = {"total_gib": psutil.virtual_memory().total / GiB, "available_gib": avail / GiB,
                       "fraction": a.host_fraction, "planned_gib": a.host_fraction * avail / GiB}
        print(f"scratch {nvme}: {scratch['fstype']}, {scratch['free_gib']:.1f} GiB free ({scratch['why']}); "
              f"{scratch['tmp']} is {scratch['tmp_fstype']}", flush=True)
        model = ["--num-layers", str(a.layers or 1), "--hidden-size", str(a.hidden), "--num-attention-heads",
                 str(a.heads), "--ffn-hidden-size", str(a.ffn), "--seq-length", str(a.seq),
                 "--vocab-size", str(a.vocab + 1), "--nproc-per-node", "1", "--device", a.device,
                 "--nvme-path", nvme] + (["--bf16"] if a.device == "cuda" else [])
        if a.peak_tflops and a.device == "cuda":
            model += ["--device-tflops", f"{a.peak_tflops:.1f}"]
        out["peak_tflops"] = a.peak_tflops

        # The whole machine, planned only.
        whole = None
        if not a.no_whole_machine:
            rc, whole, err = plan(model + ["--largest", "--host-memory-gib", f"{out['host']['planned_gib']:.2f}"])
            out["whole_machine"] = plan_summary(whole) if whole else {"error": err.splitlines()[-1] if err else rc}
        if whole:
            w = out["whole_machine"]
            print(f"whole machine: largest {w['largest_layers']} layers ({(w['largest_parameters'] or 0) / 1e9:.2f}B), "
                  f"offload {w['offload']}, predicted {w['predicted_step_s'] or 0:.1f} s/step", flush=True)
        save()

        # The trained run: the slice's largest (or --layers), with the planner's config.
        log = a.log or (os.path.splitext(a.json)[0] + ".log" if a.json else
                        os.path.join(LOGS_DIR, f"gpu_max_scale-{datetime.datetime.now():%Y%m%d-%H%M%S}.log"))
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        cfg = os.path.splitext(log)[0] + "_ds.json"  # beside the log
        sliced = ["--host-memory-gib", str(a.slice_host_gib), "--nvme-free-gib", str(a.slice_disk_gib),
                  "--offload", a.offload]
        if a.device == "cuda":
            sliced += ["--device-memory-gib", str(a.slice_device_gib)]
        rc, trained, err = plan(model + ([] if a.layers else ["--largest"]) + sliced + ["--write-ds-config", cfg])
        if not trained or rc != 0:
            reason = trained["message"].splitlines()[0] if trained else (err.splitlines()[-1] if err else f"exit {rc}")
            out.update(status="failed", error=f"planner: {reason}")
            save()
            print(f"gpu_max_scale: planner: {reason}", file=sys.stderr)
            return 1
        out["trained_plan"] = plan_summary(trained)
        if a.device_rate is not None:
            with open(cfg, encoding="utf-8") as f:
                ds = json.load(f)
            ds["zero_optimization"]["prefetch_cache_sub_group_rate"] = a.device_rate
            with open(cfg, "w", encoding="utf-8") as f:
                json.dump(ds, f, indent=1)
            out["notes"].append(f"prefetch_cache_sub_group_rate {a.device_rate:g} (--device-rate) instead of the "
                                f"planner's {trained['option']['rate']:g}")
        out["slice"] = {"device_gib": a.slice_device_gib if a.device == "cuda" else None,
                        "host_gib": a.slice_host_gib, "disk_gib": a.slice_disk_gib}
        save()
        cmd = [*torchrun(sys.executable, 1), "pretrain_gpt.py", *trained["megatron_args"],
               "--global-batch-size", str(trained["option"]["micro_batch_size"]), "--train-iters", str(a.steps),
               "--lr", "1e-4", "--lr-decay-style", "constant", *mock_trainer_flags(a.vocab, a.device),
               "--deepspeed", "--deepspeed_config", cfg]
        print(f"trained: {out['trained_plan']['message']}\n$ {' '.join(cmd)}\nlog: {log}", flush=True)
        disk = DiskMonitor(nvme)
        timeout = max(1.0, deadline - time.monotonic())
        rc, wall = run_job(cmd, log, timeout, dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1)))
        out["run"] = measured(log, disk.stop(), wall, rc, timeout, a, out["trained_plan"]["need_gib"])
        out["status"] = out["run"]["status"]
        save()
        if terminated():  # the stage's limit came during the run, which is recorded
            raise Terminated()
        return 0 if out["status"] == "ok" else 1
    except Terminated:
        out["status"] = "timeout"
        out["notes"].append("stopped by SIGTERM (the stage's time limit)")
        save()
        return 124
    finally:
        scratch_pages = out.get("scratch", {}).get("path")
        if scratch_pages and not a.keep_pages:
            shutil.rmtree(os.path.join(scratch_pages, "zc_pages"), ignore_errors=True)


def measured(log: str, disk_peak_gib: float, wall: float, rc: int | None, timeout: float, a: argparse.Namespace,
             need_gib: dict[str, float]) -> dict:
    """The training run's figures from its log (one line per iteration), the bytes of states the engine reports
    per tier, and the page files' peak disk space."""
    from tools.plot_run import LogParseError, parse_log, summary

    res = {"log": log, "wall_s": wall, "disk_peak_gib": disk_peak_gib, "steps": [], "losses": [], "peak_gib": {},
           "states_gib": {}}
    try:
        run = parse_log(log)
        res.update(steps=run.step_time_s, losses=run.lm_loss, peak_gib=summary(run)["peak_memory_gib"])
    except LogParseError:
        pass
    # The engine's own report (memory_report().by_tier, logged as "<tier> states" GiB every iteration).
    res["states_gib"] = {k.split()[0]: v for k, v in res["peak_gib"].items() if k.endswith(" states")}
    steady = res["steps"][1:] or res["steps"]
    res["step_s"] = statistics.median(steady) if steady else None
    res["fixed_s"] = max(0.0, wall - sum(res["steps"]))  # process start, imports, model build, teardown
    if rc is None:
        res["status"] = "incomplete"
        res["error"] = f"{cut_reason(timeout, wall)} ({len(res['steps'])} steps logged)"
    elif rc or len(res["steps"]) != a.steps:
        res["status"], res["error"] = "failed", first_error(os.path.dirname(log), log, rc or 1)
    elif a.offload == "nvme" and not res["states_gib"].get("nvme"):
        res["status"] = "failed"
        res["error"] = (f"--offload nvme (the plan: {need_gib.get('nvme', 0):.2f} GiB on SSD) but the engine reports "
                        f"no states there (states GiB by tier: {res['states_gib'] or 'none logged'})")
    else:
        res["status"] = "ok"
    if res["status"] != "ok":
        res["log_tail"] = log_tail(log)
    return res


if __name__ == "__main__":
    sys.exit(main())
