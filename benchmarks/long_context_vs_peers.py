"""The longest sequence a ~100M GPT trains at on this machine within a per-rank memory budget, ours without and
with context parallelism against DeepSpeed-Ulysses, and tokens/s at a common long sequence.

    source benchmarks/peers_env.sh                  # once: DeepSpeed in its own venv (benchmarks/.venv-peers)
    python -m benchmarks.long_context_vs_peers      # 109.7M GPT (RoPE), 2 ranks on gloo, fp32, 6 GiB per rank
    python -m benchmarks.long_context_vs_peers --preset tiny --seq 1024 --min-seq 256 --max-seq 4096 \\
        --granularity 256 --budget-gib 0.5 --steps 2 --table ''    # the whole pipeline in ~6 minutes

The configurations (--systems), each its own torchrun job per trial, 2 ranks (--nproc):

- ours-dp[-full]: ``pretrain_gpt.py --deepspeed`` (zero_cache ZeRO-3) without context parallelism: data
  parallel, each rank a whole sequence of its own (``-full``: ``--recompute-granularity full``).
- ours-cp-p2p / -a2a [-selective / -full] / -allgather: ``--context-parallel-size`` --cp with that
  ``--cp-comm-type``, each sequence split over --cp ranks. A flag the trainer rejects (its one ``error:``
  line) makes the row "not available" with that line, and the benchmark goes on.
- deepspeed-ulysses[-full]: benchmarks/peer_workers/deepspeed_ulysses.py in the peers' venv: the same GPT in
  plain torch modules (our parameter names and initial values), its attention core wrapped in DeepSpeed's
  ``deepspeed.sequence.layer.DistributedAttention``, each sequence split over --cp ranks, DeepSpeed ZeRO-3
  (the stage zero3_vs_peers compares ours with) given the JSON ours gets (``BenchSpec.ds_config``);
  ``-full``: every layer under ``torch.utils.checkpoint``.

Every job trains the trainer's ``--mock-data`` samples (NullTokenizer, --vocab ids + eod, the model's vocabulary
padded as the trainer pads it) from the same seeded weights with the same AdamW, clipping and micro-batch, so
the losses of rows that see the same global batch agree (they are compared with --loss-rtol).

Longest sequence: for each configuration, trials of --trial-steps training steps (forward, backward, optimizer
update; 2 by default: some systems allocate more in their second step) of one micro-batch per data-parallel rank,
each a fresh torchrun job, the sequence doubled from --min-seq up to --max-seq, then bisected between the longest
that fit and the shortest that did not, to --granularity tokens. The peak RSS grows linearly with the sequence (SDPA
keeps no s x s matrix), so the two longest trials that fit predict the longest for the budget: a doubling that would
pass that prediction tries one --granularity past it instead, and a bisection probe is the prediction when it falls
inside the bracket, else the midpoint; on a linear peak the search ends one or two trials after the doubling, and
every verdict is a trial's. A trial fits when its steps complete and the peak RSS of its largest rank is within
--budget-gib. Peak RSS is each rank's kernel high-water mark (VmHWM in /proc/<pid>/status, sampled every 0.1 s; the
workers' own ru_maxrss folded in), the same measure for every system; a trial whose rank passes the budget is
stopped there. The machine is shared: a job is also stopped when the machine's available memory falls under
--guard-gib (that trial is marked, its row's figure is then a lower bound: rerun it).

tokens/s: at the common sequence --seq (0: the longest every context-parallel row and DeepSpeed-Ulysses trained),
a job of --warmup + --steps steps, each of --global-batch sequences (default 0: one micro-batch per data-parallel
rank, the trials' step: --nproc sequences without CP, --nproc / --cp with it; a positive value is every row's, the
CP rows accumulating), the global batch's tokens over the median step time (ours: the trainer's per-iteration log
line, --log-interval 1; DeepSpeed: the worker's step time, the slowest rank). A row whose longest sequence is
below --seq is not run there. Rows with the same global batch see the same samples: their losses are compared with
the first such row's. --repeat N runs every row N times round-robin and pools each row's timed steps. The table
compares each row with DeepSpeed-Ulysses of the same recompute; the target of the acceptance issue is a longest
sequence >= DeepSpeed-Ulysses' and tokens/s >= 1.2x.

The report (command, header, table, summary, every trial, losses) is printed and written to --table (default
benchmarks/results/long_context_vs_peers.md); every job's log and files go to --run-dir (default a new folder
under benchmarks/logs/, which git ignores).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from benchmarks.peer_workers.harness import (
    BETAS,
    EPS,
    LOGS_DIR,
    ROOT,
    BenchSpec,
    first_error,
    fresh_job_dir,
    kill_tree,
    mock_trainer_flags,
    worker_env,
)
from benchmarks.zero3_vs_peers import add_report_args, add_run_args, check_run_args, machine_line, write_table
from megatron.training.config import padded_vocab_size

GIB = 2**30
PRESETS = {  # layers, hidden, heads, tokenizer vocabulary (the model pads it + eod to a multiple of 128)
    "tiny": (2, 256, 4, 1024),
    "100m": (12, 768, 12, 32000),
}
POLL_S = 0.1
BAD_INPUT = re.compile(r"\.py: error: (.+)")  # the trainer's one-line refusal of a flag (megatron/training/errors.py)


@dataclass(frozen=True)
class System:
    key: str  # --systems name
    name: str  # table row
    impl: str  # ours (pretrain_gpt.py) | ulysses (peer_workers/deepspeed_ulysses.py, peers' venv)
    cp: bool  # the sequence split over --cp ranks (context / sequence parallelism)
    comm: str  # ours' --cp-comm-type (p2p | a2a); "" without CP
    recompute: str  # "" | selective | full

    @property
    def peer(self) -> str:
        """DeepSpeed-Ulysses' row with the same recompute (selective: none, as DeepSpeed has no such mode)."""
        return "deepspeed-ulysses-full" if self.recompute == "full" else "deepspeed-ulysses"

    def parallelism(self, cp: int, nproc: int) -> str:
        if not self.cp:
            return f"DP {nproc}"
        sp = "SP" if self.impl == "ulysses" else f"CP {self.comm}"
        return f"{sp} {cp}" + (f" x DP {nproc // cp}" if nproc > cp else "")


SYSTEMS = [
    System("ours-dp", "ours: no CP (each rank a whole sequence)", "ours", False, "", ""),
    System("ours-cp-p2p", "ours: CP, ring attention (p2p)", "ours", True, "p2p", ""),
    System("ours-cp-a2a", "ours: CP, all-to-all (a2a)", "ours", True, "a2a", ""),
    System("ours-cp-allgather", "ours: CP, gathered keys and values (allgather)", "ours", True, "allgather", ""),
    System("deepspeed-ulysses", "DeepSpeed-Ulysses (DistributedAttention), ZeRO-3", "ulysses", True, "a2a", ""),
    System("ours-cp-p2p-full", "ours: CP p2p + full recompute", "ours", True, "p2p", "full"),
    System("deepspeed-ulysses-full", "DeepSpeed-Ulysses + full recompute", "ulysses", True, "a2a", "full"),
    System("ours-dp-full", "ours: no CP + full recompute", "ours", False, "", "full"),
    System("ours-cp-a2a-full", "ours: CP a2a + full recompute", "ours", True, "a2a", "full"),
    System("ours-cp-p2p-selective", "ours: CP p2p + selective recompute", "ours", True, "p2p", "selective"),
    System("ours-cp-a2a-selective", "ours: CP a2a + selective recompute", "ours", True, "a2a", "selective"),
]
BY_KEY = {s.key: s for s in SYSTEMS}
DEFAULT_SYSTEMS = ["ours-dp", "ours-cp-p2p", "ours-cp-a2a", "deepspeed-ulysses", "ours-cp-p2p-full",
                   "deepspeed-ulysses-full"]


@dataclass
class Job:
    """One torchrun job: a longest-sequence trial (--trial-steps steps) or a tokens/s run."""
    system: str
    seq: int
    status: str  # ok | over (budget) | unavailable (flag refused) | failed | timeout | guard (machine memory low)
    peak_rss: dict[int, int]  # rank -> bytes
    step_s: list[float] = field(default_factory=list)  # the slowest rank's (DeepSpeed) / the logging rank's (ours)
    losses: list[float] = field(default_factory=list)  # the global batch's mean loss per step
    error: str | None = None
    note: str | None = None  # a job that still produced every step: a crash at exit after its results
    wall_s: float = 0.0
    load_end: float = 0.0
    log: str = ""

    @property
    def peak(self) -> int:
        return max(self.peak_rss.values(), default=0)

    def fits(self, budget: int) -> bool:
        return self.status == "ok" and self.peak <= budget


@dataclass
class Search:
    trials: list[Job] = field(default_factory=list)
    longest: Job | None = None  # the longest trial that fit
    unavailable: str | None = None  # the trainer refused the configuration
    error: str | None = None  # the shortest trial failed for another reason than memory


@dataclass
class Row:
    system: System
    search: Search | None = None
    rounds: list[Job] = field(default_factory=list)  # tokens/s runs at the common sequence
    skipped: str | None = None  # why there is no tokens/s run

    @property
    def runs(self) -> list[Job]:
        return [j for j in self.rounds if j.status == "ok"]

    def timed_step_s(self, warmup: int) -> list[float]:
        return [t for j in self.runs for t in j.step_s[warmup:]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m",
                   help="model size: 100m (12 x 768, 12 heads, vocab 32000: 109.7M with RoPE; default) or tiny "
                        "(2 x 256, 4 heads, vocab 1024)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--vocab", type=int, help="override the preset's tokenizer vocabulary (the model pads it + eod)")
    add_run_args(p)
    p.set_defaults(seq=8192, micro_batch=1, global_batch=0, steps=5, warmup=1)
    p.add_argument("--cp", type=int, default=2,
                   help="context-parallel size of the CP rows and sequence-parallel size of DeepSpeed-Ulysses")
    p.add_argument("--budget-gib", type=float, default=6.0, help="per-rank memory budget: peak RSS of every rank")
    p.add_argument("--min-seq", type=int, default=1024, help="the longest-sequence search's first trial")
    p.add_argument("--max-seq", type=int, default=32768, help="the longest sequence the search tries")
    p.add_argument("--granularity", type=int, default=1024, help="the bisection's resolution in tokens")
    p.add_argument("--trial-steps", type=int, default=2,
                   help="training steps per longest-sequence trial (the peak of a step after the first counts too: "
                        "some systems allocate more in their second)")
    p.add_argument("--guard-gib", type=float, default=1.5,
                   help="stop a job when the machine's available memory falls under this (the machine is shared)")
    p.add_argument("--skip-search", action="store_true",
                   help="no longest-sequence search: tokens/s at --seq only (which must then be given)")
    p.add_argument("--skip-throughput", action="store_true", help="the longest-sequence search only")
    p.add_argument("--page-size", type=int, default=500_000_000,
                   help="ZeRO-3 allgather_bucket_size of the JSON both engines get (zero_cache's chunk size; "
                        "default: DeepSpeed's and the engine's default 5e8)")
    add_report_args(p, list(BY_KEY), "long_context_vs_peers.md")
    p.set_defaults(systems=DEFAULT_SYSTEMS, timeout=3600)
    a = p.parse_args(argv)
    check_run_args(p, a)
    if a.cp < 1 or a.nproc % a.cp:
        p.error(f"--cp {a.cp} must divide --nproc {a.nproc}")
    step = 2 * a.cp  # ours' CP holds 2 chunks of every sequence per rank
    for flag, value in (("--granularity", a.granularity), ("--min-seq", a.min_seq), ("--max-seq", a.max_seq),
                        ("--seq", a.seq)):
        if value < 0 or value % step:
            p.error(f"{flag} {value} must be a multiple of 2 x --cp = {step}")
    if a.granularity == 0 or a.min_seq == 0 or a.min_seq % a.granularity or a.max_seq % a.granularity \
            or a.max_seq < a.min_seq:
        p.error("--min-seq and --max-seq must be multiples of --granularity (> 0), --min-seq <= --max-seq")
    if a.skip_search and a.seq == 0:
        p.error("--skip-search needs a common sequence: --seq N")
    if a.skip_search and a.skip_throughput:
        p.error("--skip-search with --skip-throughput leaves nothing to run")
    if a.trial_steps < 1:
        p.error(f"--trial-steps {a.trial_steps} must be >= 1")
    return a


def shape(a: argparse.Namespace) -> tuple[int, int, int, int]:
    layers, hidden, heads, vocab = PRESETS[a.preset]
    return a.layers or layers, a.hidden or hidden, a.heads or heads, a.vocab or vocab


def global_batch(a: argparse.Namespace, system: System) -> int:
    """A tokens/s run's sequences per step: --global-batch, or one micro-batch per data-parallel rank."""
    return a.global_batch or a.micro_batch * (a.nproc // a.cp if system.cp else a.nproc)


def make_spec(a: argparse.Namespace, system: System, seq: int, trial: bool) -> BenchSpec:
    """A job's spec. A trial: --trial-steps steps of one micro-batch per data-parallel rank; a tokens/s run: the
    global batch and steps of the flags."""
    layers, hidden, heads, vocab = shape(a)
    dp = a.nproc // a.cp if system.cp else a.nproc
    return BenchSpec(layers=layers, hidden=hidden, heads=heads, vocab=padded_vocab_size(vocab + 1, 128, 1), seq=seq,
                     micro_batch=a.micro_batch, global_batch=a.micro_batch * dp if trial else global_batch(a, system),
                     steps=a.trial_steps if trial else a.steps, warmup=0 if trial else a.warmup, lr=a.lr,
                     weight_decay=a.weight_decay, clip_grad=a.clip_grad, seed=a.seed, page_size=a.page_size,
                     threads=a.threads, recompute=system.recompute == "full", mock_data_vocab=vocab)


def trainer_argv(spec: BenchSpec, system: System, a: argparse.Namespace, ds_path: str) -> list[str]:
    """pretrain_gpt.py flags of the spec's model, batches and optimizer, and of the row's parallelism."""
    argv = ["--num-layers", str(spec.layers), "--hidden-size", str(spec.hidden),
            "--num-attention-heads", str(spec.heads), "--seq-length", str(spec.seq),
            "--max-position-embeddings", str(spec.seq), "--position-embedding-type", "rope",
            "--micro-batch-size", str(spec.micro_batch), "--global-batch-size", str(spec.global_batch),
            "--train-iters", str(spec.warmup + spec.steps), "--seed", str(spec.seed), "--lr", str(spec.lr),
            "--lr-decay-style", "constant", "--weight-decay", str(spec.weight_decay), "--adam-beta1", str(BETAS[0]),
            "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS), "--clip-grad", str(spec.clip_grad),
            *mock_trainer_flags(spec.mock_data_vocab, "cpu"), "--deepspeed", "--deepspeed_config", ds_path]
    if system.cp:
        argv += ["--context-parallel-size", str(a.cp), "--cp-comm-type", system.comm]
    if system.recompute:
        argv += ["--recompute-granularity", system.recompute]
    return argv


def read_hwm(pid: int) -> int:
    """A process's peak resident set (VmHWM), bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # no /proc: the current RSS, sampled
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def monitored(cmd: list[str], env: dict, log_path: str, budget: int | None, a: argparse.Namespace,
              echo: str | None) -> tuple[int | None, str | None, dict[int, int], float]:
    """Run a torchrun job, its output in ``log_path``, sampling every rank's VmHWM (torchrun's children, by their
    RANK): (exit code or None, why it was stopped (budget | timeout | guard) or None, peak per rank, wall s).
    ``echo``: print the log lines that contain it (step lines)."""
    start = time.perf_counter()
    peaks: dict[int, int] = {}
    ranks: dict[int, int] = {}  # pid -> rank
    stopped = None
    with open(log_path, "w", encoding="utf-8") as log, open(log_path, encoding="utf-8", errors="replace") as tail:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            root = psutil.Process(proc.pid)
            while True:
                rc = proc.poll()
                try:
                    children = root.children()
                except psutil.Error:
                    children = []
                for child in children:
                    if child.pid not in ranks:
                        try:
                            ranks[child.pid] = int(child.environ().get("RANK", len(ranks)))
                        except (psutil.Error, ValueError):
                            ranks[child.pid] = len(ranks)
                    r = ranks[child.pid]
                    peaks[r] = max(peaks.get(r, 0), read_hwm(child.pid))
                if echo:
                    for line in tail.readlines():
                        if echo in line:
                            print("   " + line.strip()[:160], flush=True)
                if rc is not None:
                    break
                if budget is not None and max(peaks.values(), default=0) > budget:
                    stopped = "budget"
                elif time.perf_counter() - start > a.timeout:
                    stopped = "timeout"
                elif psutil.virtual_memory().available < a.guard_gib * GIB:
                    stopped = "guard"
                if stopped:
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        if stopped:
            log.write(f"\n[long_context_vs_peers] stopped: {stopped}\n")
    return (None if stopped else proc.returncode), stopped, peaks, time.perf_counter() - start


def run_job(system: System, spec: BenchSpec, a: argparse.Namespace, out_dir: str, budget: int | None,
            echo: bool) -> Job:
    fresh_job_dir(out_dir)
    log_path = os.path.join(out_dir, "log.txt")
    spec_path = os.path.join(out_dir, "spec.json")
    spec.save(spec_path)
    job = Job(system.key, spec.seq, "failed", {}, log=log_path)
    if system.impl == "ulysses":
        python = a.peers_python
        if not os.path.isfile(python):
            job.error = f"no python at {python}; run `source benchmarks/peers_env.sh` first"
            return job
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc), "-m",
               "benchmarks.peer_workers.deepspeed_ulysses", "--system", system.key, "--spec", spec_path,
               "--out-dir", out_dir, "--sp", str(a.cp)]
    else:
        ds_path = os.path.join(out_dir, "ds_config.json")
        dp = a.nproc // a.cp if system.cp else a.nproc
        with open(ds_path, "w", encoding="utf-8") as f:
            json.dump(spec.ds_config(dp, offload=False), f, indent=1)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
               "pretrain_gpt.py", *trainer_argv(spec, system, a, ds_path)]
    marker = ("] step " if system.impl == "ulysses" else " iteration ") if echo else None
    rc, stopped, job.peak_rss, job.wall_s = monitored(cmd, worker_env(spec.threads), log_path, budget, a, marker)
    job.load_end = os.getloadavg()[0]
    steps = spec.warmup + spec.steps
    if system.impl == "ulysses":
        complete = _read_worker(job, out_dir, a.nproc)
    else:
        _read_trainer_log(job, log_path)
        complete = len(job.step_s) == steps
    if stopped == "budget":
        job.status = "over"
        job.error = f"stopped at a peak RSS of {job.peak / GIB:.2f} GiB"
    elif stopped:
        job.status = stopped
        job.error = f"stopped after {a.timeout:.0f} s" if stopped == "timeout" else \
            f"stopped: the machine's available memory fell under --guard-gib {a.guard_gib}"
    elif complete and len(job.step_s) == steps:
        job.status, job.error = "ok", None
        if rc != 0:  # every step done and (the worker) its results written: a crash in teardown
            job.note = f"{first_error(out_dir, log_path, rc)}, after every step (log: {log_path})"
    else:
        refused = _bad_input(log_path) if system.impl == "ours" and not job.step_s else None
        job.status = "unavailable" if refused else "failed"
        job.error = refused or first_error(out_dir, log_path, rc if rc is not None else 1)
    return job


def _read_worker(job: Job, out_dir: str, nproc: int) -> bool:
    """The peer worker's per-rank files: step times (slowest rank), losses, its own peak RSS; whether every rank
    wrote its results (after its last step and a barrier), else the steps of its partial files."""
    ranks, complete = [], True
    for r in range(nproc):
        for name in (f"result_rank{r}.json", f"partial_rank{r}.json"):
            path = os.path.join(out_dir, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    ranks.append(json.load(f))
                complete = complete and name.startswith("result")
                break
    if len(ranks) != nproc:
        return False
    done = min(len(r["step_s"]) for r in ranks)
    job.step_s = [max(r["step_s"][i] for r in ranks) for i in range(done)]
    job.losses = ranks[0]["losses"][:done]
    for r, res in enumerate(ranks):
        job.peak_rss[r] = max(job.peak_rss.get(r, 0), int(res["peak_rss"]))
    return complete


def _read_trainer_log(job: Job, log_path: str) -> None:
    """The trainer's per-iteration lines (--log-interval 1): seconds, lm loss and the logging rank's peak RSS."""
    from tools.plot_run import LogParseError, parse_log

    try:
        run = parse_log(log_path)
    except LogParseError:
        return
    job.step_s, job.losses = run.step_time_s, run.lm_loss
    logged = max((x for x in run.memory_gib.get("peak rss", []) if x == x), default=0.0)
    if logged * GIB > job.peak:  # the logging rank's own figure (its rank is not in the line): fold it in
        r = max(job.peak_rss, key=job.peak_rss.get) if job.peak_rss else 0
        job.peak_rss[r] = int(logged * GIB)


def _bad_input(log_path: str) -> str | None:
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = BAD_INPUT.search(line)
            if m:
                return m.group(1).strip()
    return None


def search(row: Row, a: argparse.Namespace, run_dir: str) -> Search:
    """Doubling from --min-seq while the step fits the budget, then bisection to --granularity."""
    s, budget = Search(), int(a.budget_gib * GIB)

    def trial(seq: int) -> Job:
        spec = make_spec(a, row.system, seq, trial=True)
        job = run_job(row.system, spec, a, os.path.join(run_dir, row.system.key, f"seq{seq}"), budget, echo=False)
        s.trials.append(job)
        verdict = "fits" if job.fits(budget) else job.status if job.status != "ok" else "over"
        print(f"   {row.system.key} seq {seq}: {verdict}, peak RSS {job.peak / GIB:.2f} GiB"
              + (f", step {job.step_s[0]:.1f} s" if job.step_s else "") + f" ({job.wall_s:.0f} s wall)"
              + (f": {job.error}" if job.error and verdict != "over" else ""), flush=True)
        return job

    seq, over = a.min_seq, None
    while True:
        job = trial(seq)
        if job.status == "unavailable":
            s.unavailable = job.error
            return s
        if not job.fits(budget):
            over = job
            if s.longest is None and job.status not in ("over", "guard"):
                s.error = job.error
            break
        s.longest = job
        if seq >= a.max_seq:
            break
        seq = min(2 * seq, a.max_seq)
        guess = predicted(s.trials, budget, a.granularity)
        if guess is not None and guess + a.granularity < seq:  # past the line's longest: check just past it
            seq = max(s.longest.seq, guess) + a.granularity
    if s.longest is None or over is None:
        return s
    lo, hi, g = s.longest.seq, over.seq, a.granularity
    while hi - lo > g:
        guess = predicted(s.trials, budget, g)
        if guess is not None and guess <= lo:
            probe = lo + g  # the line says the next one does not fit: check it (an over trial is stopped early)
        elif guess is not None and guess < hi:
            probe = guess
        else:
            probe = max(lo + g, (lo + hi) // 2 // g * g)
        job = trial(probe)
        if job.fits(budget):
            lo, s.longest = probe, job
        else:
            hi = probe
    return s


def predicted(trials: list[Job], budget: int, granularity: int) -> int | None:
    """The sequence (rounded down to ``granularity``) at which the line through the two longest fitting trials'
    peaks reaches ``budget``; None without two of them or a growing peak."""
    fits = sorted((j for j in trials if j.fits(budget)), key=lambda j: j.seq)[-2:]
    if len(fits) < 2 or fits[1].peak <= fits[0].peak:
        return None
    per_token = (fits[1].peak - fits[0].peak) / (fits[1].seq - fits[0].seq)
    return int(fits[1].seq + (budget - fits[1].peak) / per_token) // granularity * granularity


def common_seq(rows: list[Row], a: argparse.Namespace) -> int | None:
    """--seq, or (0) the longest that every context-parallel row and DeepSpeed-Ulysses trained."""
    if a.seq:
        return a.seq
    longest = [r.search.longest.seq for r in rows if r.system.cp and r.search and r.search.longest]
    return min(longest) if longest else None


def fmt_longest(r: Row, a: argparse.Namespace) -> tuple[str, str]:
    """(longest cell, peak RSS cell)."""
    s = r.search
    if s is None:
        return "not searched", ""
    if s.unavailable:
        return f"not available: {s.unavailable.replace('|', '/')}", ""
    if s.longest is None:
        why = f"failed: {s.error.replace('|', '/')}" if s.error else f"< {a.min_seq} (over budget)"
        return why, f"{s.trials[0].peak / GIB:.2f} (at {a.min_seq})" if s.trials and s.trials[0].peak else ""
    j = s.longest
    cell = f"{j.seq}" + (" (= --max-seq)" if j.seq >= a.max_seq else "")
    if any(t.status == "guard" for t in s.trials):
        cell += " (a trial hit --guard-gib: lower bound)"
    return cell, " / ".join(f"{j.peak_rss[k] / GIB:.2f}" for k in sorted(j.peak_rss))


def table(rows: list[Row], a: argparse.Namespace, seq: int | None) -> list[str]:
    ok = {r.system.key: r for r in rows if r.runs}
    refs: dict[int, Row] = {}  # global batch -> the first row that trained it: the same samples, the same losses
    for r in ok.values():
        refs.setdefault(global_batch(a, r.system), r)
    out = [f"| configuration | parallelism | recompute | longest seq within {a.budget_gib:g} GiB/rank | peak RSS at "
           f"it, rank 0 / 1 (GiB) | trials | tokens/s at seq {seq or '-'} | vs DeepSpeed-Ulysses (same recompute) "
           f"| median step (s) | peak RSS at seq {seq or '-'} (GiB) | global batch | step-1 / last loss "
           f"| vs reference loss (same global batch) | load at end |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        s = r.system
        longest, rss = fmt_longest(r, a)
        trials = len(r.search.trials) if r.search else 0
        head = f"| {s.name} | {s.parallelism(a.cp, a.nproc)} | {s.recompute or 'none'} | {longest} | {rss} | {trials}"
        if not r.runs:
            failed = next((j for j in r.rounds if j.status != "ok"), None)
            why = r.skipped or (f"{failed.status}: {(failed.error or '').replace('|', '/')}" if failed else "")
            out.append(f"{head} | {why} | | | | | | | |")
            continue
        gb = global_batch(a, s)
        step = statistics.median(r.timed_step_s(a.warmup))
        peer = ok.get(s.peer)
        ratio = f"{tokens_per_s(r, a, seq) / tokens_per_s(peer, a, seq):.2f}x" if peer else "-"
        losses, ref = r.runs[0].losses, refs[gb]
        check = "reference"
        if ref is not r:
            rel = max(abs(x - y) / abs(y) for x, y in zip(losses, ref.runs[0].losses))
            check = f"{rel:.1e} {'ok' if rel <= a.loss_rtol else f'**MISMATCH** (> {a.loss_rtol:g})'} (vs " \
                    f"{ref.system.key})"
        peak = max(j.peak for j in r.runs)
        load = " / ".join(f"{j.load_end:.1f}" for j in r.rounds)
        out.append(f"{head} | {tokens_per_s(r, a, seq):.1f} | {ratio} | {step:.2f} | {peak / GIB:.2f} | {gb} "
                   f"| {losses[0]:.6f} / {losses[-1]:.6f} | {check} | {load} |")
    return out


def tokens_per_s(r: Row, a: argparse.Namespace, seq: int) -> float:
    """The row's global batch tokens over its median timed step (every round pooled)."""
    return global_batch(a, r.system) * seq / statistics.median(r.timed_step_s(a.warmup))


def summary(rows: list[Row], a: argparse.Namespace, seq: int | None) -> list[str]:
    """Ours against DeepSpeed-Ulysses: longest sequence per recompute setting and overall, tokens/s per row."""
    def longest(r: Row) -> int:
        return r.search.longest.seq if r.search and r.search.longest else 0

    lines = []
    ours = [r for r in rows if r.system.impl == "ours" and r.search]
    peers = [r for r in rows if r.system.impl == "ulysses" and r.search]
    for label, pick in (("no recompute", lambda r: r.system.recompute != "full"),
                        ("full recompute", lambda r: r.system.recompute == "full"), ("any", lambda r: True)):
        mine = max((r for r in ours if pick(r)), key=longest, default=None)
        theirs = max((r for r in peers if pick(r)), key=longest, default=None)
        if mine and theirs and longest(mine) and longest(theirs):
            ratio = longest(mine) / longest(theirs)
            lines.append(f"longest ({label}): ours {longest(mine)} ({mine.system.key}) vs DeepSpeed-Ulysses "
                         f"{longest(theirs)} ({theirs.system.key}): {ratio:.2f}x (target >= 1.00x: "
                         f"{'met' if ratio >= 1 else 'NOT met'})")
    ok = {r.system.key: r for r in rows if r.runs}
    for r in rows:
        peer = ok.get(r.system.peer)
        if r.system.impl == "ours" and r.runs and peer:
            ratio = tokens_per_s(r, a, seq) / tokens_per_s(peer, a, seq)
            lines.append(f"tokens/s at seq {seq} {r.system.key} / {peer.system.key}: {ratio:.2f}x (target >= 1.2x: "
                         f"{'met' if ratio >= 1.2 else 'NOT met'})")
    return lines


def details(rows: list[Row], budget: int) -> list[str]:
    """Every trial (sequence: verdict, peak RSS of the largest rank) and every tokens/s run's losses."""
    out = []
    for r in rows:
        if r.search:
            cells = [f"{j.seq} {'fits' if j.fits(budget) else 'over' if j.status == 'ok' else j.status} "
                     f"{j.peak / GIB:.2f}" for j in r.search.trials]
            out.append(f"  {r.system.key:<24} trials  " + " | ".join(cells))
        for i, j in enumerate(r.runs):
            tag = "losses " if len(r.rounds) == 1 else f"round {i + 1}"
            out.append(f"  {r.system.key:<24} {tag} " + " ".join(f"{x:.6f}" for x in j.losses))
    return out


def header(a: argparse.Namespace) -> list[str]:
    from megatron.core.transformer_config import TransformerConfig

    layers, hidden, heads, vocab = shape(a)
    model_vocab = padded_vocab_size(vocab + 1, 128, 1)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            seq_length=max(a.seq, a.max_seq), padded_vocab_size=model_vocab,
                            position_embedding_type="rope")
    dp = a.nproc // a.cp
    seq = f"seq {a.seq}" if a.seq else "the shortest longest sequence of the CP rows and DeepSpeed-Ulysses"
    tokens = [] if a.skip_throughput else [
        f"tokens/s: {seq}, global batch " + (f"{a.global_batch} sequences ({a.nproc} DP ranks, or {dp} x "
                                              f"{a.global_batch // (a.micro_batch * dp)} accumulation with CP)"
                                              if a.global_batch else "one micro-batch per data-parallel rank")
        + f", {a.warmup} warm-up + {a.steps} timed steps, median step; {a.repeat} round(s)"]
    search = [] if a.skip_search else [
        f"longest: per-rank budget {a.budget_gib:g} GiB of peak RSS (VmHWM of every rank), {a.trial_steps} step(s) "
        f"of one micro-batch per data-parallel rank per trial, doubling from {a.min_seq} to at most {a.max_seq}, "
        f"then bisection to {a.granularity} tokens"]
    return [
        f"GPT {cfg.num_parameters() / 1e6:.1f}M params ({layers} layers, hidden {hidden}, {heads} heads, RoPE, vocab "
        f"{model_vocab} = {vocab} + eod padded, tied embeddings, GeLU MLP 4h, LayerNorm), fp32, gloo, {a.nproc} ranks, "
        f"micro-batch {a.micro_batch}; CP / SP size {a.cp} (x DP {dp}); ZeRO-3 JSON for both engines (page "
        f"{a.page_size:.3g} elements); AdamW lr {a.lr}, wd {a.weight_decay}, clip {a.clip_grad}; trainer mock data",
        *search,
        *tokens,
        machine_line(a.threads, a.peers_python),
    ]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    try:
        lines = header(a)
    except ValueError as e:  # a model shape the GPT cannot take, caught before any job starts
        raise SystemExit(f"long_context_vs_peers.py: error: {e}") from None
    heads = shape(a)[2]
    if heads % a.cp:
        raise SystemExit(f"long_context_vs_peers.py: error: {heads} heads are not divisible by --cp {a.cp} "
                         "(DeepSpeed-Ulysses and ours' a2a split the heads)")
    run_dir = a.run_dir or os.path.join(LOGS_DIR, f"long_context_vs_peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(run_dir, exist_ok=True)
    print("\n".join(lines) + f"\nlogs: {run_dir}", flush=True)
    rows = [Row(BY_KEY[k]) for k in a.systems]
    started = time.perf_counter()
    if not a.skip_search:
        for n, row in enumerate(rows):
            print(f"[search {n + 1}/{len(rows)}] {row.system.name} ...", flush=True)
            row.search = search(row, a, run_dir)
            cell, rss = fmt_longest(row, a)
            print(f"[search {n + 1}/{len(rows)}] {row.system.key}: longest {cell}" + (f", peak RSS {rss} GiB" if rss
                  else "") + f" ({time.perf_counter() - started:.0f} s so far)", flush=True)
    seq = common_seq(rows, a)
    if not a.skip_throughput:
        todo = []
        for row in rows:
            s = row.search
            if s is not None and s.unavailable:
                row.skipped = "not available"
            elif seq is None:
                row.skipped = "no common sequence (no CP row trained)"
            elif s is not None and (s.longest is None or s.longest.seq < seq):
                row.skipped = f"longest below seq {seq}"
            else:
                todo.append(row)
        jobs = len(todo) * a.repeat
        for n in range(jobs):
            row, round_index = todo[n % len(todo)], n // len(todo)
            tag = f"[tokens/s {n + 1}/{jobs}]" + (f" round {round_index + 1}" if a.repeat > 1 else "")
            print(f"{tag} {row.system.name} at seq {seq} ...", flush=True)
            name = "throughput" if a.repeat == 1 else f"throughput-round{round_index + 1}"
            job = run_job(row.system, make_spec(a, row.system, seq, trial=False), a,
                          os.path.join(run_dir, row.system.key, name), None, echo=True)
            row.rounds.append(job)
            state = f"{job.status}: {job.error}" if job.status != "ok" else \
                f"{global_batch(a, row.system) * seq / statistics.median(job.step_s[a.warmup:]):.1f} tokens/s"
            print(f"{tag} {row.system.key}: {state} ({job.wall_s:.0f} s wall, {time.perf_counter() - started:.0f} s "
                  "so far)", flush=True)
    out = table(rows, a, seq)
    notes = summary(rows, a, seq) + [f"{r.system.key} seq {j.seq}: {j.note}" for r in rows
                                for j in (r.search.trials if r.search else []) + r.rounds if j.note]
    steps = details(rows, int(a.budget_gib * GIB))
    print("\n" + "\n".join(lines) + "\n\n" + "\n".join(out))
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    print("\ntrials (seq verdict peak-RSS-GiB of the largest rank) and losses per step at the common sequence:\n"
          + "\n".join(steps))
    if a.table:
        write_table(a.table, argv, lines, out, notes, steps, script="long_context_vs_peers",
                    steps_title="Trials (sequence, verdict, peak RSS of the largest rank in GiB) and losses per step "
                                "(global batch mean) at the common sequence:")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "common_seq": seq, "header": lines, "table": out, "summary": notes,
                       "rows": [{"system": r.system.key, "skipped": r.skipped,
                                 "search": dataclasses.asdict(r.search) if r.search else None,
                                 "rounds": [dataclasses.asdict(j) for j in r.rounds]} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
