"""The largest GPT one machine trains, ours against DeepSpeed ZeRO-3, and s/step at a common size.

    python -m benchmarks.max_scale --nvme-path /tmp/zc_maxscale              # ours at 5.0B + both at 1.04B
    python -m benchmarks.max_scale --ours-sizes 3.6 5.0 --compare-size 1.04  # more capacity attempts
    python -m benchmarks.max_scale --rerun-deepspeed-capacity 0.74:cpu 2.5:nvme 2.7:nvme   # ~15 min each
    python -m benchmarks.max_scale --ours-sizes --compare-size 0.23   # the comparison at 2 layers (minutes)
    python -m benchmarks.max_scale --ours-sizes 0.33 0.94 1.04 --offload nvme --host-memory-gib 10 --compare-size 0

The family is the one the recorded DeepSpeed capacity figures were measured on: GPT, hidden 2048, 16 heads, FFN 4x,
vocabulary 32000 with an untied output layer, sequence 256, micro-batch 1, 2 ranks on gloo, fp32, full
activation recomputation, the number of layers grown (size in billions -> layers: 50.4M per layer + 131.6M
of embeddings). Every attempt trains 3 optimizer steps of AdamW (lr 1e-4 constant, no warm-up, weight decay 0.1
on matrices, betas 0.9/0.95, gradient norm clipped at 1) on the trainer's ``--mock-data`` tokens, seed 1234.

- Ours: `pretrain_gpt.py --deepspeed` (the product path: the model is built on the meta device and sharded
  chunk by chunk) with the config ``tools/plan_memory.py`` chooses for that size on this machine: the
  fastest that fits for the capacity attempts, every state on SSD (``--offload nvme``) for the s/step
  comparison; its training log is kept for ``tools/plot_run.py``.
- DeepSpeed: ``benchmarks/peer_workers`` (the same GPTModel built under ``deepspeed.zero.Init``) in the
  peers' venv (``source benchmarks/peers_env.sh`` once). It gets what the trainer builds and reads: the
  vocabulary padded as the trainer pads it (32000 + eod -> 32128 rows), the same per-parameter seeds, the
  trainer's mock samples in the trainer's order and the same optimizer, so both start from the same weights
  and their losses (the comparison's last column) agree. It is given the same offload JSON with the planner's
  memory-bounding ``stage3_*`` / ``reduce_bucket_size`` values for that size (DeepSpeed's defaults keep up
  to 1e9 parameters gathered).
- Capacity of DeepSpeed is not a noisy figure and an attempt takes ~15 minutes, so it is cached with
  DeepSpeed's version and the machine's RAM and free disk. The recorded attempts are
  ``benchmarks/max_scale_deepspeed.json`` (in git); ``--rerun-deepspeed-capacity`` measures them again and
  writes the updated cache to --log-dir/deepspeed_capacity.json, which later runs read instead. The s/step
  comparison is always measured in this run.

Peak memory is the summed proportional set size (PSS: shared pages counted once) of every process of the
job, sampled each second; disk is the growth of used space on --nvme-path's filesystem. The table goes to
stdout and to --out-dir/max_scale.md (default benchmarks/results/max_scale/) with the command, date and
machine. The planner's configs, the training logs, DeepSpeed's job folders and attempts.json go to --log-dir
(default benchmarks/logs/max_scale/, which git ignores).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil

from benchmarks.peer_workers.harness import (
    BETAS,
    EPS,
    LOGS_DIR,
    PEERS_PYTHON,
    RESULTS_DIR,
    ROOT,
    BenchSpec,
    kill_tree,
    mock_trainer_flags,
    worker_cmd,
    worker_env,
)
from megatron.training.config import padded_vocab_size
from ptm_planner.plan import OFFLOADS
from tools.plot_run import LogParseError, parse_log

RECORDED_CACHE = os.path.join(ROOT, "benchmarks", "max_scale_deepspeed.json")  # the recorded attempts (in git)
CACHE_NAME = "deepspeed_capacity.json"  # in --log-dir: the cache as --rerun-deepspeed-capacity updates it
HIDDEN, HEADS, FFN, VOCAB, SEQ, RANKS, STEPS = 2048, 16, 8192, 32000, 256, 2, 3
PER_LAYER = 12 * HIDDEN * HIDDEN + 13 * HIDDEN  # attention + MLP matrices, biases, two LayerNorms
FIXED = 2 * VOCAB * HIDDEN + SEQ * HIDDEN + 2 * HIDDEN  # word embeddings, untied head, positions, final norm
# The trainer's model: NullTokenizer adds eod to the vocabulary, padded to a multiple of 128 (32128 rows).
MODEL_VOCAB = padded_vocab_size(VOCAB + 1, 128, 1)
# Both systems' optimizer: AdamW at a constant learning rate (no warm-up, no decay), clipped at norm 1.
LR, WEIGHT_DECAY, CLIP_GRAD, SEED = 1e-4, 0.1, 1.0, 1234


def layers_for(billions: float) -> int:
    return max(1, round((billions * 1e9 - FIXED) / PER_LAYER))


def params_of(layers: int) -> int:
    return layers * PER_LAYER + FIXED


@dataclass
class Attempt:
    system: str  # ours | deepspeed
    offload: str  # where the states live: none | cpu | cpu+nvme | nvme
    layers: int
    params: int
    ok: bool = False
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # the global batch's mean loss, per step
    peak_mem_gib: float = 0.0
    peak_disk_gib: float = 0.0
    peak_rss_gib: float = 0.0  # ours: the peak RSS of the logging rank, from its last log line
    setup_s: float = 0.0
    note: str = ""  # why it failed, or where the figure came from
    log: str = ""

    @property
    def steady_s(self) -> float | None:
        """Median of the steps after the first (the first records the prefetch trace)."""
        rest = self.step_s[1:] or self.step_s
        return statistics.median(rest) if rest else None


class JobMonitor:
    """Peak summed PSS of a process tree and peak growth of used disk space, sampled every second."""

    def __init__(self, root_pid: int, disk_path: str):
        self.root, self.disk_path = psutil.Process(root_pid), disk_path
        self.disk0 = psutil.disk_usage(disk_path).used
        self.peak_mem = self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            total = 0
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                continue
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_mem = max(self.peak_mem, total)
            self.peak_disk = max(self.peak_disk, psutil.disk_usage(self.disk_path).used - self.disk0)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()
        return self.peak_mem / 2**30, self.peak_disk / 2**30


def _run_job(cmd: list[str], log_path: str, nvme: str, timeout_s: float, env: dict) -> tuple[int, float, float]:
    print(f"  $ {shlex.join(cmd)}\n    log: {log_path}", flush=True)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)
        mon = JobMonitor(proc.pid, nvme)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # the whole tree: torchrun starts each rank in a session of its own
            rc = proc.wait()
            log.write(f"\n[max_scale] killed after {timeout_s:.0f} s\n")
        mem, disk = mon.stop()
    return rc, mem, disk


def _tail(path: str, n: int = 3) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return " / ".join(lines[-n:])[-400:]


def plan_config(layers: int, nvme: str, log_dir: str, offload: str,
                host_memory_gib: float | None = None) -> tuple[str, list[str], str]:
    """Ask the planner for this size's zero_cache config on this machine (exit 3: it does not fit), or for a
    machine with ``host_memory_gib`` of RAM; returns the config path, the Megatron flags and the offload mode
    it chose."""
    cfg, args = (os.path.join(log_dir, f"ours_{offload}_{layers}l.json"),
                 os.path.join(log_dir, f"ours_{offload}_{layers}l.args"))
    # --vocab-size is the tokenizer's: NullTokenizer's VOCAB ids and its eod (as MODEL_VOCAB above).
    cmd = [sys.executable, "tools/plan_memory.py", "--num-layers", str(layers), "--hidden-size", str(HIDDEN),
           "--num-attention-heads", str(HEADS), "--ffn-hidden-size", str(FFN), "--seq-length", str(SEQ),
           "--vocab-size", str(VOCAB + 1), "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
           "--nproc-per-node", str(RANKS), "--recompute-activations", "--nvme-path", nvme,
           "--offload", offload, "--write-ds-config", cfg, "--write-args", args]
    if host_memory_gib is not None:
        cmd += ["--host-memory-gib", str(host_memory_gib)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(res.stdout.rstrip(), flush=True)
    if res.returncode != 0:
        raise RuntimeError(f"planner says {layers} layers do not fit (exit {res.returncode}): "
                           f"{(res.stdout + res.stderr).strip()[-300:]}")
    chosen = re.search(r"option: offload=(\S+),", res.stdout)
    with open(args, encoding="utf-8") as f:
        return cfg, [ln.strip() for ln in f if ln.strip()], chosen.group(1) if chosen else offload


def run_ours(layers: int, offload: str, a, log_dir: str, cache_rate: float | None = None,
             host_memory_gib: float | None = None) -> Attempt:
    """``offload``: the planner's mode (auto: the fastest that fits; nvme: states on SSD, the planner still
    caching the share of optimizer sub-groups spare memory holds). ``cache_rate`` overrides that share
    (0: every state on SSD, as DeepSpeed's NVMe offload); ``host_memory_gib`` plans for that much RAM."""
    att = Attempt("ours", offload, layers, params_of(layers))
    try:
        cfg, model_args, att.offload = plan_config(layers, a.nvme_path, log_dir, offload, host_memory_gib)
    except RuntimeError as e:
        att.note = str(e)
        return att
    with open(cfg, encoding="utf-8") as f:
        ds = json.load(f)
    if cache_rate is not None:  # the planner's per-tier budgets assumed its own share: use the defaults
        ds["zero_optimization"]["prefetch_cache_sub_group_rate"] = cache_rate
        ds["zero_optimization"].pop("memory_budget", None)
        cfg = cfg.replace(".json", f"_rate{cache_rate}.json")
        with open(cfg, "w", encoding="utf-8") as f:
            json.dump(ds, f, indent=1)
    rate = ds["zero_optimization"].get("prefetch_cache_sub_group_rate", 0.0)
    att.system = f"ours (prefetch_cache_sub_group_rate {rate})"
    att.log = os.path.join(log_dir, f"ours_{offload}_{layers}l_rate{rate}.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           "pretrain_gpt.py", *model_args,
           "--global-batch-size", str(RANKS), "--train-iters", str(STEPS), "--seed", str(SEED),
           "--lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", str(WEIGHT_DECAY),
           "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS),
           "--clip-grad", str(CLIP_GRAD), *mock_trainer_flags(VOCAB, "cpu"), "--deepspeed", "--deepspeed_config", cfg]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    t0 = time.perf_counter()
    rc, att.peak_mem_gib, att.peak_disk_gib = _run_job(cmd, att.log, a.nvme_path, a.timeout, env)
    att.step_s, att.losses, att.peak_rss_gib = _logged_steps(att.log)
    att.ok = rc == 0 and len(att.step_s) == STEPS
    att.setup_s = time.perf_counter() - t0 - sum(att.step_s)
    att.note = "" if att.ok else f"exit {rc}: {_tail(att.log)}"
    return att


def _logged_steps(log_path: str) -> tuple[list[float], list[float], float]:
    """Seconds and lm loss of every logged iteration (the trainer logs each one here: --log-interval 1), and
    the logging rank's peak RSS at its last line (GiB)."""
    try:
        run = parse_log(log_path)
    except LogParseError:  # the job died before its first iteration
        return [], [], 0.0
    return run.step_time_s, run.lm_loss, max(run.memory_gib.get("peak rss", []), default=0.0)


# The zero_optimization keys both engines read that bound live memory: DeepSpeed gets the planner's values for
# ours, not its defaults (stage3_max_live_parameters 1e9 keeps 4 GB of fp32 parameters gathered per rank).
SHARED_ZERO_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                    "stage3_param_persistence_threshold")


def shared_zero_keys(layers: int, a, log_dir: str) -> dict:
    cfg, _, _ = plan_config(layers, a.nvme_path, log_dir, "nvme")
    with open(cfg, encoding="utf-8") as f:
        zero = json.load(f)["zero_optimization"]
    shared = {k: zero[k] for k in SHARED_ZERO_KEYS if k in zero}
    # DeepSpeed's gradient bucket gets our page size (our reductions move one page at a time).
    shared["reduce_bucket_size"] = zero["allgather_bucket_size"]
    return shared


def run_deepspeed(layers: int, offload: str, a, log_dir: str) -> Attempt:
    att = Attempt("deepspeed", offload, layers, params_of(layers))
    if not os.path.exists(PEERS_PYTHON):
        att.note = "peers' venv missing: run `source benchmarks/peers_env.sh` once"
        return att
    try:
        zero_keys = shared_zero_keys(layers, a, log_dir)
    except RuntimeError as e:  # past our capacity the planner has no config: DeepSpeed keeps its defaults
        print(f"  {e}; DeepSpeed runs with its default stage3_* keys", flush=True)
        zero_keys = {}
    job = os.path.join(log_dir, f"deepspeed_{offload}_{layers}l")
    os.makedirs(job, exist_ok=True)
    # The trainer's model, seed, batches and optimizer (run_ours), so both start from the same weights and
    # their losses agree as at 100M.
    spec = BenchSpec(layers=layers, hidden=HIDDEN, heads=HEADS, vocab=MODEL_VOCAB, seq=SEQ, micro_batch=1,
                     global_batch=RANKS, steps=STEPS - 1, warmup=1, lr=LR, weight_decay=WEIGHT_DECAY,
                     clip_grad=CLIP_GRAD, seed=SEED, page_size=26_000_000, threads=a.threads, offload_device=offload,
                     nvme_path=a.nvme_path, sub_group_size=10_000_000, untie_embeddings=True, recompute=True,
                     # DeepSpeed's parameter swap buffers (5 of them) must each hold the largest parameter
                     # (the 65.8M-element embedding); its default, 1e8 elements, costs 2 GB per rank. And
                     # max_in_cpu (default 1e9 elements: 4 GB per rank) keeps parameters in RAM besides.
                     param_buffer_size=MODEL_VOCAB * HIDDEN, param_max_in_cpu=0, zero_keys=zero_keys,
                     mock_data_vocab=VOCAB)
    spec_path = os.path.join(job, "spec.json")
    spec.save(spec_path)
    att.log = os.path.join(job, "log.txt")
    cmd = worker_cmd(PEERS_PYTHON, RANKS, "deepspeed", f"deepspeed-{offload}", spec_path, job, offload=True)
    env = worker_env(a.threads)
    rc, att.peak_mem_gib, att.peak_disk_gib = _run_job(cmd, att.log, a.nvme_path, a.timeout, env)
    shutil.rmtree(os.path.join(a.nvme_path, "zero_stage_3"), ignore_errors=True)  # DeepSpeed leaves its swap files
    result = os.path.join(job, "result_rank0.json")
    if rc == 0 and os.path.exists(result):
        with open(result, encoding="utf-8") as f:
            r = json.load(f)
        att.ok, att.step_s, att.losses, att.setup_s = True, r["step_s"], r["losses"], r["setup_s"]
    else:
        att.note = f"exit {rc}: {_tail(att.log)}"
    return att


def deepspeed_version() -> str:
    if not os.path.exists(PEERS_PYTHON):
        return "not installed"
    res = subprocess.run([PEERS_PYTHON, "-c", "import deepspeed; print(deepspeed.__version__)"],
                         capture_output=True, text=True, env=worker_env(1))
    return res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else "unknown"


def machine(nvme: str) -> dict:
    return {"ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "disk_free_gib": round(psutil.disk_usage(nvme).free / 2**30, 1), "cpus": os.cpu_count(),
            "host": platform.node()}


def load_cache(log_dir: str) -> dict:
    """DeepSpeed's capacity attempts: this log folder's cache if a rerun wrote one, else the recorded ones."""
    for path in (os.path.join(log_dir, CACHE_NAME), RECORDED_CACHE):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    return {"attempts": []}


def save_cache(cache: dict, log_dir: str) -> str:
    path = os.path.join(log_dir, CACHE_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(cache, f, indent=1)
    os.replace(tmp, path)
    return path


def _fmt_s(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def _fmt_rss(att: Attempt) -> str:
    return f"{att.peak_rss_gib:.2f}" if att.peak_rss_gib else "-"


def table(ours: list[Attempt], ds_cached: list[dict], compare: list[Attempt]) -> str:
    out = ["### Capacity (3 steps each)", "",
           "| system | offload | layers | params (B) | trains | s/step (steps 2-3) | peak memory (GiB) "
           "| peak RSS of a rank (GiB) | disk (GiB) | source |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for att in ours:
        out.append(f"| {att.system} | {att.offload} | {att.layers} | {att.params / 1e9:.2f} "
                   f"| {'yes' if att.ok else 'NO'} "
                   f"| {_fmt_s(att.steady_s)} | {att.peak_mem_gib:.1f} | {_fmt_rss(att)} | {att.peak_disk_gib:.1f} "
                   f"| this run"
                   f"{'' if att.ok else ': ' + att.note[:160]} |")
    for d in ds_cached:
        steady = d.get("s_per_step") or "-"
        out.append(f"| DeepSpeed ZeRO-3 | {d['offload']} | {d['layers']} | {d['params'] / 1e9:.2f} | "
                   f"{'yes' if d['ok'] else 'NO'} | {steady} | {d.get('peak_mem_gib', '-')} | - | "
                   f"{d.get('disk_gib', '-')} | {d['source']} |")
    out += ["", "Peak memory: this run's rows are the summed PSS of the job's processes; cached rows are what their "
                "source measured. Peak RSS of a rank: the kernel's high-water mark of the rank that logs, from its "
                "last log line."]
    largest_ours = max((a.params for a in ours if a.ok), default=0)
    largest_ds = max((d["params"] for d in ds_cached if d["ok"]), default=0)
    if largest_ours and largest_ds:
        out += ["", f"Largest that trains: ours {largest_ours / 1e9:.2f}B, DeepSpeed {largest_ds / 1e9:.2f}B "
                    f"({largest_ours / largest_ds:.2f}x)."]
    if compare:
        out += ["", "### Seconds per step at a common size, same run (states on SSD)", "",
                "| system | layers | params (B) | s/step (steps 2-3) | first step (s) | set-up (s) | peak memory "
                "(GiB) | peak RSS of a rank (GiB) | disk (GiB) | speed-up vs DeepSpeed | loss per step |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        ds = next((a for a in compare if a.system == "deepspeed" and a.ok), None)
        for att in compare:
            speed = (f"{ds.steady_s / att.steady_s:.2f}x" if ds is not None and att.ok and att.steady_s else "-")
            first = _fmt_s(att.step_s[0]) if att.step_s else "-"
            steady = _fmt_s(att.steady_s) if att.ok else "failed: " + att.note[:120]
            losses = ", ".join(f"{x:.6f}" for x in att.losses) or "-"
            out.append(f"| {att.system} | {att.layers} | {att.params / 1e9:.2f} | {steady} "
                       f"| {first} | {att.setup_s:.0f} | {att.peak_mem_gib:.1f} | {_fmt_rss(att)} "
                       f"| {att.peak_disk_gib:.1f} | {speed} "
                       f"| {losses} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", default="/tmp/zc_maxscale", help="directory on the SSD for both systems' swap")
    p.add_argument("--ours-sizes", type=float, nargs="*", default=[5.0], help="capacity attempts, billions")
    p.add_argument("--offload", default="auto", choices=["auto", *OFFLOADS],
                   help="the planner's offload mode for the capacity attempts (auto: the fastest that fits)")
    p.add_argument("--host-memory-gib", type=float,
                   help="plan the capacity attempts for this much RAM per node instead of the machine's")
    p.add_argument("--compare-size", type=float, default=1.04, help="s/step comparison size, billions (0: skip)")
    p.add_argument("--rerun-deepspeed-capacity", nargs="*", default=None, metavar="BILLIONS:OFFLOAD",
                   help="measure DeepSpeed's capacity attempts again (e.g. 0.74:cpu 1.79:nvme) and update the cache")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per attempt")
    p.add_argument("--out-dir", default=os.path.join(RESULTS_DIR, "max_scale"),
                   help="where the printed table goes, as max_scale.md (default: %(default)s)")
    p.add_argument("--log-dir", default=os.path.join(LOGS_DIR, "max_scale"),
                   help="planner configs, training logs, DeepSpeed's job folders, attempts.json and the updated "
                        "DeepSpeed capacity cache (default: %(default)s)")
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    os.makedirs(a.log_dir, exist_ok=True)
    os.makedirs(a.nvme_path, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)

    cache = load_cache(a.log_dir)
    if a.rerun_deepspeed_capacity is not None:
        version, box = deepspeed_version(), machine(a.nvme_path)
        for item in a.rerun_deepspeed_capacity:
            size, _, offload = item.partition(":")
            att = run_deepspeed(layers_for(float(size)), offload or "nvme", a, a.log_dir)
            # A new measurement replaces this script's earlier one; figures from other sources stay.
            cache["attempts"] = [d for d in cache["attempts"] if (d["layers"], d["offload"]) != (att.layers, offload)
                                 or not d["source"].startswith("measured by max_scale.py")]
            cache["attempts"].append({"offload": att.offload, "layers": att.layers, "params": att.params,
                                      "ok": att.ok, "s_per_step": _fmt_s(att.steady_s),
                                      "peak_mem_gib": round(att.peak_mem_gib, 1),
                                      "disk_gib": round(att.peak_disk_gib, 1), "deepspeed": version, **box,
                                      "source": f"measured by max_scale.py {started:%Y-%m-%d}"
                                                + ("" if att.ok else f" ({att.note[:120]})")})
            print(f"  DeepSpeed capacity cache: {save_cache(cache, a.log_dir)}", flush=True)

    ours = []
    for size in a.ours_sizes:
        print(f"[max_scale] ours at {size}B ({layers_for(size)} layers)", flush=True)
        ours.append(run_ours(layers_for(size), a.offload, a, a.log_dir, host_memory_gib=a.host_memory_gib))
    compare = []
    if a.compare_size > 0:
        layers = layers_for(a.compare_size)
        print(f"[max_scale] s/step at {a.compare_size}B ({layers} layers): ours, then DeepSpeed", flush=True)
        compare = [run_ours(layers, "nvme", a, a.log_dir, cache_rate=0.0), run_ours(layers, "nvme", a, a.log_dir),
                   run_deepspeed(layers, "nvme", a, a.log_dir)]

    ds_rows = sorted(cache["attempts"], key=lambda d: (d["offload"], d["layers"]))
    report = table(ours, ds_rows, compare)
    header = (f"## Max scale, {started:%Y-%m-%d %H:%M} UTC\n\n`python -m benchmarks.max_scale "
              f"{shlex.join(sys.argv[1:] if argv is None else argv)}` on {json.dumps(machine(a.nvme_path))}, "
              f"DeepSpeed {deepspeed_version()}; GPT h{HIDDEN}/{HEADS} heads/FFN {FFN}/vocab {VOCAB} untied, seq "
              f"{SEQ}, micro-batch 1, {RANKS} ranks (gloo, fp32, full recompute), {STEPS} steps per attempt.\n")
    text = header + "\n" + report + "\n"
    print("\n" + text)
    with open(os.path.join(a.out_dir, "max_scale.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(a.log_dir, "attempts.json"), "w", encoding="utf-8") as f:
        json.dump([asdict(x) for x in ours + compare], f, indent=1)


if __name__ == "__main__":
    main()
