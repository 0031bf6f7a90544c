"""What every system's worker shares: the spec, the model, the batches, the timed loop and peak RSS; and what
the drivers that start the workers share: one job run under a time limit, its telling error line.

Every system trains the same GPTModel (tensor/pipeline size 1, seeded per-parameter init, no dropout) on
the same synthetic tokens with the same optimizer hyper-parameters, so their losses must agree; only the
data-parallel machinery differs. A system is a ``Trainer``: ``micro_batch`` runs forward and backward of one
micro-batch and, on the last micro-batch of a global batch, the optimizer update. ``BenchSpec.device`` picks
CPU + gloo (the default) or one GPU per rank + NCCL; ``BenchSpec.dtype`` fp32 or bf16 compute (fp32 master
weights and optimizer states either way).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Protocol

import psutil
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS_PYTHON = os.path.join(ROOT, "benchmarks", ".venv-peers", "bin", "python")  # benchmarks/peers_env.sh
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")  # printed tables and plots (in git)
LOGS_DIR = os.path.join(ROOT, "benchmarks", "logs")  # raw logs, per-attempt files, caches (ignored by git)


def worker_env(threads: int) -> dict[str, str]:
    """A worker's environment, in either venv: the source tree on the path (workers run as
    ``-m benchmarks.peer_workers.<module>``), ``threads`` intra-op threads, DeepSpeed on its CPU accelerator
    with a persistent cache for the ops it JIT-builds."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ptm/torch_extensions"))
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL a job and everything under it. Killing a torchrun's process group is not enough: it starts each
    rank in a session of its own, and a rank left behind would keep its GPU memory."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


class Terminated(Exception):
    """SIGTERM to a driver (raise_on_sigterm): its caller's time limit."""


_terminated = False


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises Terminated, and terminated() stays true so that no later job starts."""

    def handler(signum, frame):
        global _terminated
        _terminated = True
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def terminated() -> bool:
    return _terminated


def run_job(cmd: list[str], log_path: str, timeout_s: float, env: dict) -> tuple[int | None, float]:
    """Run ``cmd`` from the repository root in a session of its own, the command line then its output in
    ``log_path``: (exit code, or None when cut short by ``timeout_s`` or SIGTERM; wall seconds). A job cut short
    goes whole; the caller still reads what it wrote (terminated() tells a SIGTERM, which it must then honour)."""
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, Terminated):
            rc = None
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    return rc, time.perf_counter() - start


def cut_reason(timeout_s: float, wall_s: float) -> str:
    """Why run_job returned None."""
    return f"stopped by SIGTERM after {wall_s:.0f} s" if _terminated else f"killed after {timeout_s:.0f} s"


# Log lines that name a crash without a Python exception (a rank killed by a signal), most telling first.
CRASH_MARKERS = ("terminate called", "Segmentation fault", "Killed", "traceback : Signal")


def first_error(out_dir: str, log_path: str, rc: int) -> str:
    """The failing rank's exception (one line), else the log's crash or last error line, else the exit code."""
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("error_rank"):
            with open(os.path.join(out_dir, name), encoding="utf-8") as f:
                return f.readline().strip()
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f]
    for marker in CRASH_MARKERS:
        hits = [ln for ln in lines if marker in ln]
        if hits:
            return f"exit code {rc}: {hits[0]}"
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return errors[-1] if errors else f"exit code {rc}"


def log_tail(log_path: str, lines: int = 40) -> list[str]:
    """The last ``lines`` lines of a job's log (a failed rank's traceback is there: torchrun passes its output on)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return [ln.rstrip("\n") for ln in f][-lines:]
    except OSError:
        return []


def write_error(out_dir: str, rank: str, e: BaseException) -> None:
    """A worker rank's failure where ``first_error`` finds it: the exception's first line, then the traceback."""
    with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w", encoding="utf-8") as f:
        f.write(f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__)
        f.write("\n" + traceback.format_exc())


def fresh_job_dir(out_dir: str) -> None:
    """Make ``out_dir``; a reused one must not lend this job an earlier job's rank files."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.startswith(("result_rank", "error_rank", "partial_rank")):
            os.remove(os.path.join(out_dir, name))


def torchrun(python: str, nproc: int) -> list[str]:
    """torchrun for ``nproc`` ranks on this machine, over the loopback address. ``--standalone`` would give each
    rank the host's FQDN as MASTER_ADDR: on a machine without network whose hostname is not in /etc/hosts that
    name does not resolve and every job hangs at its rendezvous. Port 0: the store takes a free port."""
    return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            "127.0.0.1:0", "--local-addr", "127.0.0.1", "--nproc-per-node", str(nproc)]


def worker_cmd(python: str, nproc: int, impl: str, system: str, spec_path: str, out_dir: str,
               offload: bool) -> list[str]:
    """One system's torchrun job of ``benchmarks.peer_workers.worker``."""
    return [*torchrun(python, nproc), "-m", "benchmarks.peer_workers.worker", "--impl", impl, "--system", system,
            "--spec", spec_path, "--out-dir", out_dir] + (["--offload"] if offload else [])


def mock_trainer_flags(vocab: int, device: str) -> list[str]:
    """pretrain_gpt.py flags every benchmark run of the trainer shares: no dropout, the mock samples of a
    NullTokenizer vocabulary (the ones BenchSpec.mock_data_vocab reproduces), every iteration logged (for
    tools/plot_run.py), no evaluation, no loader workers."""
    return ["--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(vocab), "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--distributed-backend", "nccl" if device == "cuda" else "gloo"]


BETAS = (0.9, 0.95)
EPS = 1e-8
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=15)


@dataclass(frozen=True)
class BenchSpec:
    layers: int
    hidden: int
    heads: int
    vocab: int  # the (already padded) vocabulary size of the model
    seq: int
    micro_batch: int
    global_batch: int
    steps: int  # timed steps, after the warm-up ones
    warmup: int
    lr: float
    weight_decay: float
    clip_grad: float
    seed: int
    page_size: int  # zero_cache's chunk size (allgather_bucket_size); DeepSpeed ignores the key in stage 3
    threads: int  # intra-op threads per rank
    # Max-scale runs (benchmarks/max_scale.py): where offloaded states go, and the model's shape switches.
    offload_device: str = "cpu"  # cpu | nvme (used when a system offloads)
    nvme_path: str = ""
    sub_group_size: int = 1_000_000_000
    untie_embeddings: bool = False
    recompute: bool = False
    param_buffer_size: int = 0  # offload_param.buffer_size for nvme (DeepSpeed: >= the largest parameter)
    param_max_in_cpu: int = -1  # offload_param.max_in_cpu for nvme (DeepSpeed keeps that many elements in RAM)
    # zero_optimization keys both engines read (stage3_max_live_parameters, reduce_bucket_size, ...); empty:
    # their defaults. Max-scale runs give DeepSpeed the values the planner chose for ours.
    zero_keys: dict = dataclasses.field(default_factory=dict)
    # 0: Zipf tokens (synthetic_tokens). N: the samples `pretrain_gpt.py --mock-data --tokenizer-type
    # NullTokenizer --vocab-size N` trains on (ids below N, eod N), so a system here sees the trainer's batches.
    mock_data_vocab: int = 0
    device: str = "cpu"  # cpu (gloo) | cuda (NCCL, the GPU of LOCAL_RANK)
    dtype: str = "fp32"  # fp32 | bf16: the compute precision; masters and optimizer states stay fp32
    # Steps after the timed ones run under torch.profiler; the trace's copy/compute overlap goes into the result.
    profile_steps: int = 0
    # The MLP and mixture of experts (benchmarks/moe_vs_peers.py, max_scale_moe.py); the defaults are the dense
    # GeLU GPT of the other benchmarks. ffn_hidden 0: 4 x hidden.
    ffn_hidden: int = 0
    swiglu: bool = False
    num_experts: int = 0  # 0: dense; else every layer's MLP is a mixture of this many experts
    moe_topk: int = 2
    moe_ffn_hidden: int = 0  # each expert's width (0: ffn_hidden)
    moe_aux_loss_coeff: float = 0.0
    expert_parallel: int = 1  # ranks that split the experts (--expert-model-parallel-size)
    # The DeepSpeed JSON's ZeRO stage: 3, or 2 (DeepSpeed's native MoE refuses stage 3; offload is then of the
    # optimizer states only, stage 2 having no parameter offload).
    zero_stage: int = 3
    # The synthetic tokens' law (with mock_data_vocab 0): zipf (a Zipf-like unigram law, learnable) or uniform
    # (every id equally likely: a mixture of experts' router then starts near an even load).
    token_law: str = "zipf"
    # FSDP2 only: 0 shards over every rank; N > 0 is HSDP, a 2-D mesh (replicate = world / N, shard = N) that
    # shards inside blocks of N consecutive ranks (a host's, under torchrun) and all-reduces across them.
    hsdp_shard_size: int = 0

    @classmethod
    def load(cls, path: str) -> "BenchSpec":
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    def grad_accumulation(self, world: int) -> int:
        if self.global_batch % (self.micro_batch * world):
            raise ValueError(f"--global-batch {self.global_batch} is not divisible by --micro-batch "
                             f"{self.micro_batch} x {world} ranks; choose sizes that divide")
        return self.global_batch // (self.micro_batch * world)

    def ds_config(self, world: int, offload: bool) -> dict:
        """The one DeepSpeed-style JSON both ZeRO-3 engines (ours and DeepSpeed) are given; at ``zero_stage`` 2,
        DeepSpeed-MoE's (moe_vs_peers.py)."""
        stage3 = {"sub_group_size": self.sub_group_size} if self.zero_stage == 3 else {}
        zero: dict = {"stage": self.zero_stage, "allgather_bucket_size": self.page_size, **stage3, **self.zero_keys}
        if offload:
            # Pinned host buffers only where there is a bus to copy over: a GPU's DMA needs them, a CPU run
            # would only lock pages.
            where = {"device": self.offload_device, "pin_memory": self.device == "cuda"}
            if self.offload_device == "nvme":
                where["nvme_path"] = self.nvme_path
            zero["offload_optimizer"] = dict(where)
            if self.zero_stage < 3:  # stages 1-2 shard no parameters, so they have none to offload
                return self._ds_json(world, zero)
            zero["offload_param"] = dict(where)
            if self.param_buffer_size:
                zero["offload_param"]["buffer_size"] = self.param_buffer_size
            if self.param_max_in_cpu >= 0:
                zero["offload_param"]["max_in_cpu"] = self.param_max_in_cpu
        return self._ds_json(world, zero)

    def _ds_json(self, world: int, zero: dict) -> dict:
        precision = {"bf16": {"enabled": True}} if self.dtype == "bf16" else {}
        return {
            **precision,
            "train_batch_size": self.global_batch,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accumulation(world),
            "gradient_clipping": self.clip_grad,
            "steps_per_print": 1_000_000,
            "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": self.weight_decay}},
            "zero_optimization": zero,
        }


class Trainer(Protocol):
    def micro_batch(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                    last: bool) -> torch.Tensor:
        """Forward + backward of one micro-batch (+ the update when ``last``); returns the detached mean loss."""


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay on matrices only, as the trainer's backends do (no decay on biases and norms)."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_model(spec: BenchSpec, precision: str = "fp32") -> torch.nn.Module:
    """Our GPTModel on one tensor/pipeline rank, on the CPU, parameters in ``precision``; every rank builds the
    same weights (seeded by name). A system that builds the model its own way (sharded while it is created)
    wraps this call; one that keeps fp32 masters and casts for compute (FSDP2, DDP) takes the fp32 default."""
    from megatron.core import parallel_state as ps
    from megatron.model.gpt_model import GPTModel

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, timeout=COLLECTIVE_TIMEOUT)
    return GPTModel(model_config(spec, precision))


def model_config(spec: BenchSpec, precision: str = "fp32"):
    """The TransformerConfig of the spec's GPT (with its mixture of experts, if any)."""
    from megatron.core.moe.config import MoEConfig
    from megatron.core.transformer_config import TransformerConfig

    moe = None
    if spec.num_experts:
        moe = MoEConfig(num_experts=spec.num_experts, router_topk=spec.moe_topk,
                        ffn_hidden_size=spec.moe_ffn_hidden or None, aux_loss_coeff=spec.moe_aux_loss_coeff)
    return TransformerConfig(num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                             ffn_hidden_size=spec.ffn_hidden or None, swiglu=spec.swiglu,
                             seq_length=spec.seq, padded_vocab_size=spec.vocab, hidden_dropout=0.0,
                             attention_dropout=0.0, seed=spec.seed,
                             untie_embeddings_and_output_weights=spec.untie_embeddings,
                             recompute_granularity="full" if spec.recompute else None, precision=precision, moe=moe)


def compute_device(spec: BenchSpec) -> torch.device:
    """This rank's device: the CPU, or the GPU torchrun's LOCAL_RANK names."""
    if spec.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def synthetic_tokens(spec: BenchSpec) -> torch.Tensor:
    """[steps, global batch, seq + 1] tokens drawn from a Zipf-like unigram law (learnable, so the loss moves) or
    uniformly (``spec.token_law``), or the trainer's mock samples (``spec.mock_data_vocab``); profiled steps come
    after the timed ones."""
    total = spec.warmup + spec.steps + spec.profile_steps
    if spec.mock_data_vocab:
        from megatron.data.mock_dataset import MockGPTDataset

        # The trainer reads train samples 0, 1, ... in order, one global batch per step (data_samplers.py).
        n = total * spec.global_batch
        data = MockGPTDataset("train", n, spec.seq, spec.mock_data_vocab + 1, spec.seed, eod=spec.mock_data_vocab)
        return torch.stack([torch.from_numpy(data[i]["text"]) for i in range(n)]).view(
            total, spec.global_batch, spec.seq + 1)
    n = total * spec.global_batch * (spec.seq + 1)
    g = torch.Generator().manual_seed(spec.seed)
    if spec.token_law == "uniform":
        return torch.randint(0, spec.vocab, (total, spec.global_batch, spec.seq + 1), generator=g)
    if spec.token_law != "zipf":
        raise ValueError(f"token_law {spec.token_law!r}: use zipf or uniform")
    weights = 1.0 / torch.arange(1, spec.vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=True, generator=g).view(total, spec.global_batch, spec.seq + 1)


def moe_step_stats(model: torch.nn.Module) -> dict:
    """Our GPT's mixture-of-experts statistics since the last call, on this rank: the balancing loss (times its
    coefficient, averaged over layers and micro-batches) and the most and least imbalanced layer's load (max /
    mean choices per expert); {} for a dense model."""
    stats = getattr(model, "moe_stats", None)
    return stats.reduce_and_reset(None, torch.device("cpu")) if stats is not None else {}


class PeakRss:
    """Largest resident set size of this process, sampled with psutil by a daemon thread."""

    def __init__(self, interval_s: float = 0.01):
        self._proc = psutil.Process()
        self.peak = self._proc.memory_info().rss
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak


def _profile(step: Callable[[int], float], steps: range, device: torch.device, out_dir: str, rank: int) -> dict:
    """Run ``steps`` under torch.profiler, keep the Chrome trace in ``out_dir`` and return how much of its
    host <-> device copy time ran under compute kernels (read by benchmarks/trace_overlap.py)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.trace_overlap import report_from_trace

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for s in steps:
            step(s)
    path = os.path.join(out_dir, f"trace_rank{rank}.json")
    prof.export_chrome_trace(path)
    report = report_from_trace(path)
    return {**dataclasses.asdict(report), "hidden": report.hidden, "line": report.line(), "trace": path}


def run(spec: BenchSpec, system: str, make_trainer: Callable[[torch.nn.Module, BenchSpec, int], Trainer],
        out_dir: str, rss: PeakRss, build: Callable[[BenchSpec], torch.nn.Module] = build_model) -> None:
    """Build, train warm-up + timed (+ profiled) steps, write ``result_rank{r}.json`` (step times and losses on
    every rank, peak RSS, peak device memory, the profiled steps' copy/compute overlap); ``partial_rank{r}.json``
    holds the steps done so far while it runs."""
    device = compute_device(spec)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)  # before NCCL starts, so its communicator is on this rank's GPU
    dist.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(spec.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = spec.grad_accumulation(world)
    start = time.perf_counter()
    model = build(spec)
    trainer = make_trainer(model, spec, gas)
    if cuda:
        torch.cuda.synchronize()
    setup_s = time.perf_counter() - start
    tokens = synthetic_tokens(spec).to(device)
    positions = torch.arange(spec.seq, device=device).expand(spec.micro_batch, spec.seq)
    step_s, losses = [], []
    timed = spec.warmup + spec.steps

    def step(s: int) -> float:
        """One global batch; returns its mean loss over every rank's micro-batches."""
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for m in range(gas):
            first = (m * world + rank) * spec.micro_batch
            batch = tokens[s, first:first + spec.micro_batch]
            total += trainer.micro_batch(batch[:, :-1], positions, batch[:, 1:], last=m == gas - 1).double()
        dist.all_reduce(total)  # the global batch's mean loss; also lines the ranks up for timing
        return total.item() / (gas * world)  # .item() waits for the GPU: the step's time includes its kernels

    partial = os.path.join(out_dir, f"partial_rank{rank}.json")
    stats = []  # per step, what the trainer says about it (a mixture of experts: balancing loss, load)
    for s in range(timed):
        t0 = time.perf_counter()
        losses.append(step(s))
        step_s.append(time.perf_counter() - t0)
        stats.append(trainer.step_stats() if hasattr(trainer, "step_stats") else {})
        # The steps so far, rewritten after each one: a job killed at its time limit still has figures.
        with open(partial, "w", encoding="utf-8") as f:
            json.dump({"step_s": step_s, "losses": losses, "peak_rss": rss.peak,
                       "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0}, f)
        if rank == 0:
            print(f"[{system}] step {s + 1}/{timed}: loss {losses[-1]:.6f}, {step_s[-1]:.2f} s, "
                  f"{spec.global_batch * spec.seq / step_s[-1]:.1f} tokens/s, ETA {(timed - s - 1) * step_s[-1]:.0f} s",
                  flush=True)
    peak_device = torch.cuda.max_memory_allocated(device) if cuda else 0
    overlap = None
    if spec.profile_steps:
        try:
            overlap = _profile(step, range(timed, timed + spec.profile_steps), device, out_dir, rank)
        except Exception as e:  # a profiler that cannot trace must not cost the timed steps their record
            overlap = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300], "copies": 0}
        if rank == 0:
            print(f"[{system}] profiled {spec.profile_steps} step(s): {overlap.get('line') or overlap['error']}",
                  flush=True)
    dist.barrier()
    result = {"system": system, "rank": rank, "world": world, "setup_s": setup_s, "step_s": step_s,
              "losses": losses, "step_stats": stats, "peak_rss": rss.stop(), "threads": torch.get_num_threads(),
              "device": str(device), "dtype": spec.dtype, "peak_device_bytes": peak_device, "overlap": overlap}
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()
