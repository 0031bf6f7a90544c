"""The pipeline bubble: 1F1B, the interleaved 1F1B (virtual pipeline stages) and zero-bubble ZB-H1 on PP4.

    python -m benchmarks.pipeline_bubble [--microbatches 8 --layers 16 --steps 3 --repeats 1 --layer-ms 25]

``pretrain_gpt.py`` runs on 4 CPU ranks (gloo), one pipeline stage each, with the zero_cache engine's ZeRO-1
(``--use-distributed-optimizer``, which ZB-H1 needs), under each schedule of ``--schedules``: 1F1B, interleaved
with v = 2 and 4 model chunks per stage where the layers allow, and ZB-H1; m micro-batches per step. The table
gives the median step time next to the theoretical bubble: (p - 1) / m of the ideal time for 1F1B, (p - 1) / (v m)
interleaved, and for ZB-H1 what its rounds give when a layer's forward, input-gradient and weight-gradient parts
take equal time (computed from the schedule, ``zero_bubble_theory``).

Two kinds of compute: ``real`` runs the tiny model as it is, where 4 ranks share this machine's cores, so a
stage's idle time in the bubble goes to another stage and the schedule matters less than on separate devices;
``emulated`` adds a fixed time per layer, slept, so it takes no core, which behaves like one device per stage:
``--layer-ms`` in the forward, as much in the backward for the input gradient (a hook on the layer's output) and
as much again for the weight gradients (a quarter in each of the layer's four linear layers' weight-gradient
writes, which 1F1B runs inside the backward and ZB-H1 in its weight passes). Its ideal step is m x (layers / p) x
3 x layer-ms and the measured bubble is the step time over that, minus one (so it also holds the real compute and
the transfers, small next to the emulated time by default). The interleaved schedule sends v times as many
activations between stages, which a small model pays for. Ranks fork from a server that imported the trainer
once (a few seconds a run); the defaults take about 3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

STAGES = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(a, schedule: str, chunks: int, steps: int) -> list[str]:
    virtual = ["--virtual-pipeline-model-parallel-size", str(chunks)] if chunks > 1 else []
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(a.microbatches), "--train-iters", str(a.warmup + steps), "--lr", "1e-4",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
            "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--distributed-backend", "gloo", "--log-interval", "100000", "--eval-iters", "0", "--num-workers", "0",
            "--pipeline-model-parallel-size", str(STAGES), "--pipeline-schedule", schedule,
            "--use-distributed-optimizer", *virtual]


def _emulate_layer_time(forward_s: float) -> None:
    """Every transformer layer takes ``forward_s`` more in forward, as much for its input gradient and as much for
    its weight gradients (slept)."""
    from megatron.core.tensor_parallel import layers
    from megatron.model import transformer
    from zero_cache.weight_grad import _LinearWithWeightGradSink, weight_grad_sink

    forward, linear = transformer.TransformerLayer.forward, layers.linear
    in_layer = [False]

    def slow_forward(self, *args, **kwargs):
        time.sleep(forward_s)
        in_layer[0] = True
        try:
            out = forward(self, *args, **kwargs)
        finally:
            in_layer[0] = False
        if out.requires_grad:
            out.register_hook(lambda grad: time.sleep(forward_s))
        return out

    def slow_linear(x, weight, bias=None, *, fuse=True):  # a quarter of the weight-gradient time per linear layer
        sink = weight_grad_sink(weight) if in_layer[0] and fuse and torch.is_grad_enabled() else None
        if sink is None:
            return linear(x, weight, bias, fuse=fuse)

        def slow_sink(write):
            sink(lambda out, overwrite: (time.sleep(forward_s / 4), write(out, overwrite)))
        return _LinearWithWeightGradSink.apply(x, weight, bias, slow_sink)

    transformer.TransformerLayer.forward = slow_forward
    layers.linear = slow_linear


def _worker(rank: int, port: int, argv: list[str], layer_s: float, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(STAGES),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from megatron.training import training
    from pretrain_gpt import main

    if layer_s > 0:
        _emulate_layer_time(layer_s)
    times: list[float] = []
    train_step = training.train_step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = train_step(*args, **kwargs)
        times.append(time.perf_counter() - start)  # the grad norm's reduction over the stages ends every step
        return result

    training.train_step = timed
    main(argv)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)


def step_times(a, schedule: str, chunks: int, layer_ms: float, steps: int) -> list[float]:
    """Seconds of each of ``steps`` timed steps (after the warm-up steps) of one run on STAGES ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_worker, args=(_free_port(), _argv(a, schedule, chunks, steps), layer_ms / 1000, out),
                           nprocs=STAGES, start_method="forkserver")
        with open(out) as f:
            return json.load(f)[a.warmup:]


def zero_bubble_theory(stages: int, microbatches: int) -> float:
    """ZB-H1's bubble when forward, input-gradient and weight-gradient passes take one unit each and transfers
    none: its rounds played on every rank at once, each pass starting when its rank is free and its input has
    arrived, the step's length over the ideal 3 m units, minus one."""
    from megatron.core.pipeline_parallel.zero_bubble import ZeroBubbleH1Schedule

    queues = [[(kind, k) for r in ZeroBubbleH1Schedule(stages, rank, microbatches).rounds()
               for kind, k in ([("F", r.forward)] if r.forward is not None else [])
               + ([("B", r.backward)] if r.backward is not None else []) + [("W", w) for w in r.weights]]
              for rank in range(stages)]
    clock, done = [0.0] * stages, {}
    while any(queues):
        for rank, queue in enumerate(queues):
            while queue:
                kind, k = queue[0]
                after = {"F": done.get(("F", rank - 1, k)) if rank else 0.0,
                         "B": done.get(("B", rank + 1, k)) if rank < stages - 1 else done.get(("F", rank, k)),
                         "W": 0.0}[kind]
                if after is None:
                    break
                clock[rank] = max(clock[rank], after) + 1
                done[(kind, rank, k)] = clock[rank]
                queue.pop(0)
    return max(clock) / (3 * microbatches) - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="divisible by 4 x each v measured")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8, help="m per step, a multiple of 4")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-1f1b:2", "interleaved-1f1b:4", "zb-h1"],
                   help="NAME or NAME:v (model chunks per stage), first one the baseline")
    p.add_argument("--steps", type=int, default=3, help="timed steps per emulated run")
    p.add_argument("--real-steps", type=int, default=12, help="timed steps per real run (short ones)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved in time")
    p.add_argument("--layer-ms", type=float, default=25.0,
                   help="emulated forward time per layer (input gradient and weight gradients as much each)")
    p.add_argument("--compute", choices=["real", "emulated", "both"], default="both")
    a = p.parse_args()
    mp.set_forkserver_preload(["torch", "torch.distributed", "megatron.training.training", "pretrain_gpt"])
    runs = [(name, int(v)) for name, _, v in (s.partition(":") for s in a.schedules)
            for v in [v or 1] if a.layers % (STAGES * int(v)) == 0]
    modes = ["real", "emulated"] if a.compute == "both" else [a.compute]
    samples: dict[tuple[str, str, int], list[float]] = {(mode, *run): [] for mode in modes for run in runs}
    for _ in range(a.repeats):
        for mode in modes:
            for name, v in runs:
                emulated = mode == "emulated"
                samples[mode, name, v] += step_times(a, name, v, a.layer_ms if emulated else 0.0,
                                                     a.steps if emulated else a.real_steps)
    m = a.microbatches
    ideal_ms = m * (a.layers // STAGES) * 3 * a.layer_ms  # emulated: every stage busy all the time
    print(f"\nPP{STAGES}, m = {m} micro-batches, {a.layers} layers (hidden {a.hidden}, seq {a.seq}), ZeRO-1, "
          f"{a.real_steps} (real) / {a.steps} (emulated) timed steps x {a.repeats} runs, {os.cpu_count()} CPU cores; "
          f"emulated: {a.layer_ms} ms forward + {a.layer_ms} ms input gradient + {a.layer_ms} ms weight gradients "
          f"per layer\n")
    print(f"| compute | schedule | v | median step (ms) | vs {runs[0][0]} | theoretical bubble | measured bubble |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        base = statistics.median(samples[(mode, *runs[0])])
        for name, v in runs:
            step_ms = 1000 * statistics.median(samples[mode, name, v])
            theory = zero_bubble_theory(STAGES, m) if name == "zb-h1" else (STAGES - 1) / (v * m)
            measured = f"{step_ms / ideal_ms - 1:.1%}" if mode == "emulated" else "-"
            print(f"| {mode} | {name} | {v} | {step_ms:.0f} | {base * 1000 / step_ms:.2f}x | {theory:.1%} | "
                  f"{measured} |")


if __name__ == "__main__":
    main()
