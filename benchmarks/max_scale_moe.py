"""The largest mixture-of-experts GPT one machine trains: ours against DeepSpeed-MoE, growing the experts.

    python -m benchmarks.max_scale_moe                                   # planner's largest for ours + DeepSpeed's
    python -m benchmarks.max_scale_moe --ours-experts 6 38 --deepspeed-experts 4 6 8
    python -m benchmarks.max_scale_moe --ours-experts 4 --deepspeed-experts 4 --layers 2   # minutes: losses agree

The family: GPT of --layers (8) layers, hidden 2048, 16 heads, LayerNorm, learned positions, vocabulary 32000
(+ eod, padded to 32128 rows as the trainer pads it) with an untied output layer; every layer's MLP is a
mixture of E experts, top-2, each a bias-free SwiGLU MLP of ffn 2048 (12.6M parameters), balancing-loss
coefficient 0.01, dropless routing; sequence 256, micro-batch 1, 2 ranks on gloo, expert parallelism 2, fp32.
The experts per layer (E, a multiple of 2) are what grows: 100.7M parameters per 1 more expert in each of the 8
layers, on 266.3M of attention, norms and embeddings. Every attempt trains --steps (3) optimizer steps of AdamW
(lr 1e-4 constant, no warm-up, weight decay 0.1 on matrices, betas 0.9/0.95, clipping at norm 1) on the
trainer's ``--mock-data`` tokens, seed 1234.

- Ours: ``pretrain_gpt.py --deepspeed`` (the product path: model built on the meta device, sharded chunk by
  chunk; dense parameters ZeRO-3 over the 2 ranks, each rank's experts a group of their own) with the MoE flags
  and the config ``tools/plan_memory.py`` writes for that size on this machine (``--offload`` auto: the
  fastest that fits, which at these sizes keeps the states, the experts' included, on SSD under --nvme-path).
  The planner is asked first; its verdict (fits / does not fit) is the "planner" column, and a size it says
  does not fit is run only with --run-unplanned, to check that such a verdict is not wrong the other way.
  Without --ours-experts the size is the planner's own largest (``--largest --largest-by experts``).
- DeepSpeed: benchmarks/peer_workers/deepspeed_moe.py (the same GPT, its MoE layers DeepSpeed's native
  ``deepspeed.moe.layer.MoE`` with the same experts and the gate configured to route as ours, filled with our
  initial weights) at ZeRO stage 2, the highest DeepSpeed accepts for its native MoE (stage 3 is refused with
  it), without offload (``--deepspeed-offload none``, the default) or with ``offload_optimizer`` on the CPU
  (``cpu``; stage 2 has no parameter offload and keeps an NVMe optimizer offload in host memory). On this
  machine the host is the device, so the offload only adds buffers: no offload trains the larger model.
  Its gradient and gather buckets get the planner's page size for ours (its default, 5e8 elements, is 2 GB of
  fp32 per bucket and rank). No activation recompute (at micro-batch 1 a layer's activations are tens of MB).

Peak memory is the summed proportional set size (PSS) of the job's processes, sampled every second; disk is
the growth of used space on --nvme-path's filesystem. A job is killed (and counted as not training) when the
machine's available memory falls under --guard-gib: the machine is shared, and an out-of-memory kill could hit
other users' processes. The table goes to stdout and to --out-dir/max_scale_moe.md with the command, date and
machine; planner configs, training logs and DeepSpeed's job folders go to --log-dir.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
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

from benchmarks.max_scale import _logged_steps, _tail, deepspeed_version, machine
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
    model_config,
    worker_cmd,
    worker_env,
)
from megatron.training.config import padded_vocab_size

HIDDEN, HEADS, MOE_FFN, TOPK, VOCAB, SEQ, RANKS, EP = 2048, 16, 2048, 2, 32000, 256, 2, 2
AUX_LOSS_COEFF = 0.01
MODEL_VOCAB = padded_vocab_size(VOCAB + 1, 128, 1)  # NullTokenizer's ids and its eod, padded as the trainer does
LR, WEIGHT_DECAY, CLIP_GRAD, SEED = 1e-4, 0.1, 1.0, 1234


def spec_of(layers: int, experts: int, steps: int, threads: int, page: int = 33_554_432) -> BenchSpec:
    """The family's model as the workers take it (also what DeepSpeed trains)."""
    return BenchSpec(layers=layers, hidden=HIDDEN, heads=HEADS, vocab=MODEL_VOCAB, seq=SEQ, micro_batch=1,
                     global_batch=RANKS, steps=steps - 1, warmup=1, lr=LR, weight_decay=WEIGHT_DECAY,
                     clip_grad=CLIP_GRAD, seed=SEED, page_size=page, threads=threads, offload_device="cpu",
                     untie_embeddings=True, mock_data_vocab=VOCAB, swiglu=True, num_experts=experts, moe_topk=TOPK,
                     moe_ffn_hidden=MOE_FFN, moe_aux_loss_coeff=AUX_LOSS_COEFF, expert_parallel=EP, zero_stage=2,
                     zero_keys={"reduce_bucket_size": page})


def params_of(layers: int, experts: int) -> tuple[int, int]:
    """(total, active) parameters of the family's model."""
    cfg = model_config(spec_of(layers, experts, 3, 1))
    return cfg.num_parameters(), cfg.num_parameters(active=True)


@dataclass
class Attempt:
    system: str
    experts: int
    params: int
    active: int
    planner: str = "-"  # ours: the planner's verdict for this size (fits / does not fit) and its offload
    ok: bool = False
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_mem_gib: float = 0.0
    peak_disk_gib: float = 0.0
    peak_rss_gib: float = 0.0
    setup_s: float = 0.0
    note: str = ""
    log: str = ""

    @property
    def steady_s(self) -> float | None:
        rest = self.step_s[1:] or self.step_s
        return statistics.median(rest) if rest else None


class GuardedMonitor:
    """Peak summed PSS of a process tree and peak growth of used disk space, sampled every second; kills the
    tree when the machine's available memory falls under ``guard`` bytes."""

    def __init__(self, root_pid: int, disk_path: str, guard: int):
        self.root, self.disk_path, self.guard = psutil.Process(root_pid), disk_path, guard
        self.disk0 = psutil.disk_usage(disk_path).used
        self.peak_mem = self.peak_disk = 0
        self.killed: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_mem = max(self.peak_mem, total)
            self.peak_disk = max(self.peak_disk, psutil.disk_usage(self.disk_path).used - self.disk0)
            available = psutil.virtual_memory().available
            if available < self.guard and self.killed is None:
                self.killed = (f"killed by the memory guard: {available / 2**30:.2f} GiB available on the machine "
                               f"at a job PSS of {total / 2**30:.1f} GiB")
                kill_tree(self.root.pid)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()
        return self.peak_mem / 2**30, self.peak_disk / 2**30


def run_job(cmd: list[str], log_path: str, a, env: dict) -> tuple[int, float, float, str | None]:
    print(f"  $ {shlex.join(cmd)}\n    log: {log_path}", flush=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        mon = GuardedMonitor(proc.pid, a.nvme_path, int(a.guard_gib * 2**30))
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            rc = proc.wait()
            mon.killed = f"killed after {a.timeout:.0f} s"
        mem, disk = mon.stop()
        if mon.killed:
            log.write(f"\n[max_scale_moe] {mon.killed}\n")
    return rc, mem, disk, mon.killed


def planner_cmd(layers: int, a) -> list[str]:
    return [sys.executable, "tools/plan_memory.py", "--num-layers", str(layers), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ), "--vocab-size", str(VOCAB + 1),
            "--untie-embeddings-and-output-weights", "--swiglu", "--micro-batch-size", "1",
            "--nproc-per-node", str(RANKS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", str(MOE_FFN),
            "--moe-aux-loss-coeff", str(AUX_LOSS_COEFF), "--expert-model-parallel-size", str(EP),
            "--nvme-path", a.nvme_path, "--offload", a.offload]


def planner_largest(layers: int, a) -> int:
    """The planner's largest expert count of the family on this machine."""
    cmd = planner_cmd(layers, a) + ["--num-experts", str(EP), "--largest", "--largest-by", "experts"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(res.stdout.rstrip()[-1500:], flush=True)
    found = re.search(r"--num-experts (\d+)", res.stdout) or re.search(r"(\d+) experts", res.stdout)
    if res.returncode != 0 or not found:
        raise SystemExit(f"max_scale_moe.py: the planner found no largest size (exit {res.returncode}): "
                         f"{(res.stdout + res.stderr).strip()[-300:]}")
    return int(found.group(1))


def plan(layers: int, experts: int, a, log_dir: str) -> tuple[bool, str, str, list[str], str]:
    """(fits, the planner's verdict line, config path, Megatron flags, chosen offload)."""
    cfg = os.path.join(log_dir, f"ours_{experts}e.json")
    args = os.path.join(log_dir, f"ours_{experts}e.args")
    cmd = planner_cmd(layers, a) + ["--num-experts", str(experts), "--write-ds-config", cfg, "--write-args", args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(res.stdout.rstrip(), flush=True)
    with open(os.path.join(log_dir, f"ours_{experts}e.plan.txt"), "w", encoding="utf-8") as f:
        f.write(shlex.join(cmd) + "\n" + res.stdout + res.stderr)
    chosen = re.search(r"option: offload=(\S+),", res.stdout)
    offload = chosen.group(1) if chosen else "?"
    if res.returncode == 0:
        with open(args, encoding="utf-8") as f:
            flags = [ln.strip() for ln in f if ln.strip()]
        return True, f"fits ({offload})", cfg, flags, offload
    if res.returncode == 3:
        return False, "does not fit", cfg, [], offload
    raise SystemExit(f"max_scale_moe.py: planner error (exit {res.returncode}): {(res.stdout + res.stderr)[-300:]}")


def run_ours(layers: int, experts: int, a, log_dir: str) -> Attempt:
    att = Attempt("ours", experts, *params_of(layers, experts))
    fits, att.planner, cfg, flags, offload = plan(layers, experts, a, log_dir)
    if not fits:
        if not a.run_unplanned:
            att.note = "not run: the planner says it does not fit"
            return att
        # The planner's leanest config for a size it rejects: every state on SSD.
        res = subprocess.run(planner_cmd(layers, a)[:-2] + ["--offload", "nvme", "--num-experts", str(experts),
                                                             "--write-ds-config", cfg, "--write-args", cfg + ".args"],
                             cwd=ROOT, capture_output=True, text=True)
        if not os.path.exists(cfg + ".args"):
            att.note = f"not run: the planner wrote no config ({res.stdout[-200:]})"
            return att
        with open(cfg + ".args", encoding="utf-8") as f:
            flags = [ln.strip() for ln in f if ln.strip()]
    att.system = f"ours ({offload})"
    att.log = os.path.join(log_dir, f"ours_{experts}e.log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           "pretrain_gpt.py", *flags, "--global-batch-size", str(RANKS), "--train-iters", str(a.steps),
           "--seed", str(SEED), "--lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", str(WEIGHT_DECAY),
           "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS),
           "--clip-grad", str(CLIP_GRAD), *mock_trainer_flags(VOCAB, "cpu"), "--deepspeed", "--deepspeed_config", cfg]
    t0 = time.perf_counter()
    rc, att.peak_mem_gib, att.peak_disk_gib, killed = run_job(cmd, att.log, a, dict(os.environ,
                                                                                   OMP_NUM_THREADS=str(a.threads)))
    att.step_s, att.losses, att.peak_rss_gib = _logged_steps(att.log)
    att.ok = rc == 0 and killed is None and len(att.step_s) == a.steps
    att.setup_s = time.perf_counter() - t0 - sum(att.step_s)
    att.note = "" if att.ok else (killed or f"exit {rc}: {_tail(att.log)}")
    return att


def run_deepspeed(layers: int, experts: int, a, log_dir: str) -> Attempt:
    offload = a.deepspeed_offload == "cpu"
    att = Attempt("DeepSpeed-MoE ZeRO-2" + (" + optimizer offload (cpu)" if offload else ", no offload"), experts,
                  *params_of(layers, experts))
    if not os.path.exists(a.peers_python):
        att.note = "peers' venv missing: run `source benchmarks/peers_env.sh` once"
        return att
    job = os.path.join(log_dir, f"deepspeed_{a.deepspeed_offload}_{experts}e")
    os.makedirs(job, exist_ok=True)
    for name in os.listdir(job):
        if name.startswith(("result_rank", "error_rank", "partial_rank")):
            os.remove(os.path.join(job, name))
    spec = spec_of(layers, experts, a.steps, a.threads, a.ds_bucket)
    spec_path = os.path.join(job, "spec.json")
    spec.save(spec_path)
    att.log = os.path.join(job, "log.txt")
    cmd = worker_cmd(a.peers_python, RANKS, "deepspeed-moe", f"deepspeed-{experts}e", spec_path, job, offload=offload)
    rc, att.peak_mem_gib, att.peak_disk_gib, killed = run_job(cmd, att.log, a, worker_env(a.threads))
    files = [os.path.join(job, f"{kind}_rank0.json") for kind in ("result", "partial")]
    done = next((f for f in files if os.path.exists(f)), None)
    if done:
        with open(done, encoding="utf-8") as f:
            r = json.load(f)
        att.step_s, att.losses = r["step_s"], r["losses"]
        att.setup_s = r.get("setup_s", 0.0)
    att.ok = rc == 0 and killed is None and len(att.step_s) == a.steps
    if not att.ok:
        err = [n for n in os.listdir(job) if n.startswith("error_rank")]
        first = open(os.path.join(job, err[0]), encoding="utf-8").readline().strip() if err else _tail(att.log)
        att.note = killed or f"exit {rc}: {first}"
    return att


def _s(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def table(attempts: list[Attempt], layers: int) -> str:
    out = ["| system | experts per layer | params total / active (B) | planner | trains "
           "| s/step (steps 2+, median) | step 1 (s) | set-up (s) | peak memory (GiB, PSS) | peak RSS of a rank (GiB) "
           "| disk (GiB) | loss per step |",
           "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for t in attempts:
        losses = ", ".join(f"{x:.4f}" for x in t.losses) or "-"
        trains = "yes" if t.ok else f"NO: {t.note[:200]}"
        out.append(f"| {t.system} | {t.experts} | {t.params / 1e9:.2f} / {t.active / 1e9:.2f} | {t.planner} "
                   f"| {trains} "
                   f"| {_s(t.steady_s) if t.ok else '-'} | {_s(t.step_s[0]) if t.step_s else '-'} | {t.setup_s:.0f} "
                   f"| {t.peak_mem_gib:.1f} | {t.peak_rss_gib:.2f} | {t.peak_disk_gib:.1f} | {losses} |")
    ours = max((t.params for t in attempts if t.ok and t.system.startswith("ours")), default=0)
    ds = max((t.params for t in attempts if t.ok and t.system.startswith("DeepSpeed")), default=0)
    if ours and ds:
        out += ["", f"Largest that trains: ours {ours / 1e9:.2f}B, DeepSpeed-MoE {ds / 1e9:.2f}B ({ours / ds:.2f}x; "
                    "target >= 2x)."]
    wrong = [t for t in attempts if t.planner.startswith("fits") and not t.ok and t.log]
    if wrong:
        out += ["", "**The planner said 'fits' for a run that did not train**: "
                + ", ".join(f"{t.experts} experts" for t in wrong)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", default="/tmp/zc_maxscale_moe", help="directory on the SSD for ours' states")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ours-experts", type=int, nargs="*", default=None,
                   help="ours' attempts, experts per layer (default: the planner's largest; empty: none)")
    p.add_argument("--deepspeed-experts", type=int, nargs="*", default=[4, 6, 8],
                   help="DeepSpeed's attempts, experts per layer, smallest first (stops after the first failure)")
    p.add_argument("--deepspeed-offload", default="none", choices=["cpu", "none"],
                   help="DeepSpeed's offload_optimizer: none (default: the leaner here, so the larger that trains) "
                        "or cpu")
    p.add_argument("--offload", default="auto", choices=["auto", "none", "cpu", "cpu+nvme", "nvme"],
                   help="the planner's offload mode for ours (auto: the fastest that fits)")
    p.add_argument("--run-unplanned", action="store_true",
                   help="also run ours' sizes the planner says do not fit (every state on SSD)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per attempt")
    p.add_argument("--guard-gib", type=float, default=0.25,
                   help="kill an attempt when the machine's available memory falls under this (GiB)")
    p.add_argument("--ds-bucket", type=int, default=33_554_432,
                   help="DeepSpeed's reduce_bucket_size and allgather_bucket_size (elements; default: the "
                        "planner's page for ours)")
    p.add_argument("--peers-python", default=os.environ.get("PEERS_PYTHON", PEERS_PYTHON))
    p.add_argument("--out-dir", default=os.path.join(RESULTS_DIR, "max_scale_moe"))
    p.add_argument("--log-dir", default=os.path.join(LOGS_DIR, "max_scale_moe"))
    a = p.parse_args(argv)
    if any(e % EP or e < TOPK for e in (a.ours_experts or []) + a.deepspeed_experts):
        p.error(f"expert counts must be multiples of the expert-parallel size {EP}, at least {TOPK}")
    for d in (a.out_dir, a.log_dir, a.nvme_path):
        os.makedirs(d, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    box = machine(a.nvme_path)
    attempts: list[Attempt] = []

    def record() -> None:
        with open(os.path.join(a.log_dir, "attempts.json"), "w", encoding="utf-8") as f:
            json.dump([asdict(x) for x in attempts], f, indent=1)

    for experts in a.deepspeed_experts:
        print(f"[max_scale_moe] DeepSpeed-MoE, {experts} experts per layer "
              f"({params_of(a.layers, experts)[0] / 1e9:.2f}B)", flush=True)
        attempts.append(run_deepspeed(a.layers, experts, a, a.log_dir))
        record()
        if not attempts[-1].ok:
            break
    ours_experts = a.ours_experts if a.ours_experts is not None else [planner_largest(a.layers, a)]
    for experts in ours_experts:
        print(f"[max_scale_moe] ours, {experts} experts per layer ({params_of(a.layers, experts)[0] / 1e9:.2f}B)",
              flush=True)
        attempts.append(run_ours(a.layers, experts, a, a.log_dir))
        record()
        shutil.rmtree(os.path.join(a.nvme_path, "zero_cache_swap"), ignore_errors=True)  # a killed job leaves its pages
    total, active = params_of(a.layers, 2)
    header = (f"## Max scale, mixture of experts, {started:%Y-%m-%d %H:%M} UTC\n\n`python -m benchmarks.max_scale_moe "
              f"{shlex.join(sys.argv[1:] if argv is None else argv)}` on {json.dumps(box)}, DeepSpeed "
              f"{deepspeed_version()}; GPT {a.layers} layers, hidden {HIDDEN}, {HEADS} heads, vocab {VOCAB} untied, "
              f"every MLP E experts top-{TOPK} of SwiGLU ffn {MOE_FFN} (E = 2: {total / 1e9:.2f}B, {active / 1e9:.2f}B "
              f"active; +{(params_of(a.layers, 4)[0] - total) / 2e6:.1f}M per expert per layer), aux-loss coefficient "
              f"{AUX_LOSS_COEFF}, seq {SEQ}, micro-batch 1, {RANKS} ranks (gloo, fp32), EP {EP}, {a.steps} steps per "
              f"attempt.\n")
    text = header + "\n" + table(attempts, a.layers) + "\n"
    print("\n" + text)
    with open(os.path.join(a.out_dir, "max_scale_moe.md"), "w", encoding="utf-8") as f:
        f.write(text)
    record()


if __name__ == "__main__":
    main()
