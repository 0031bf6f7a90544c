"""The pipeline bubble: 1F1B against the interleaved 1F1B schedule (virtual pipeline stages) on PP4.

    python -m benchmarks.pipeline_bubble [--microbatches 8 --layers 16 --steps 3 --repeats 1 --layer-ms 25]

``pretrain_gpt.py`` runs on 4 CPU ranks (gloo), one pipeline stage each, with v = 1 (1F1B), 2 and 4 model chunks
per stage where the layers allow, and m micro-batches per step. The table gives the median step time next to the
theoretical bubble, (p - 1) / m of the ideal time for 1F1B and (p - 1) / (v m) interleaved.

Two kinds of compute: ``real`` runs the tiny model as it is, where 4 ranks share this machine's cores, so a
stage's idle time in the bubble goes to another stage and the schedule matters less than on separate devices;
``emulated`` adds a fixed time per layer (``--layer-ms`` forward, twice that backward, slept, so it takes no
core), which behaves like one device per stage: its ideal step is m x (layers / p) x 3 x layer-ms and the
measured bubble is the step time over that, minus one (so it also holds the real compute and the transfers,
small next to the emulated time by default). The interleaved schedule sends v times as many activations between
stages, which a small model pays for. Ranks fork from a server that imported the trainer once (a few seconds a
run); the defaults take about 2 minutes on 2 cores.
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


def _argv(a, chunks: int, steps: int) -> list[str]:
    virtual = ["--virtual-pipeline-model-parallel-size", str(chunks)] if chunks > 1 else []
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(a.microbatches), "--train-iters", str(a.warmup + steps), "--lr", "1e-4",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
            "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--distributed-backend", "gloo", "--log-interval", "100000", "--eval-iters", "0", "--num-workers", "0",
            "--pipeline-model-parallel-size", str(STAGES), *virtual]


def _emulate_layer_time(forward_s: float) -> None:
    """Every transformer layer takes ``forward_s`` more in forward and twice that in backward (slept)."""
    from megatron.model import transformer

    forward = transformer.TransformerLayer.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(forward_s)
        out = forward(self, *args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda grad: time.sleep(2 * forward_s))
        return out

    transformer.TransformerLayer.forward = slow_forward


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


def step_times(a, chunks: int, layer_ms: float, steps: int) -> list[float]:
    """Seconds of each of ``steps`` timed steps (after the warm-up steps) of one run on STAGES ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_worker, args=(_free_port(), _argv(a, chunks, steps), layer_ms / 1000, out), nprocs=STAGES,
                           start_method="forkserver")
        with open(out) as f:
            return json.load(f)[a.warmup:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="divisible by 4 x each v measured")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8, help="m per step, a multiple of 4")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], help="v values (1 = plain 1F1B)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per emulated run")
    p.add_argument("--real-steps", type=int, default=12, help="timed steps per real run (short ones)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved in time")
    p.add_argument("--layer-ms", type=float, default=25.0, help="emulated forward time per layer (backward 2x)")
    p.add_argument("--compute", choices=["real", "emulated", "both"], default="both")
    a = p.parse_args()
    mp.set_forkserver_preload(["torch", "torch.distributed", "megatron.training.training", "pretrain_gpt"])
    chunks = [v for v in a.chunks if a.layers % (STAGES * v) == 0]
    modes = ["real", "emulated"] if a.compute == "both" else [a.compute]
    samples: dict[tuple[str, int], list[float]] = {(mode, v): [] for mode in modes for v in chunks}
    for _ in range(a.repeats):
        for mode in modes:
            for v in chunks:
                emulated = mode == "emulated"
                samples[mode, v] += step_times(a, v, a.layer_ms if emulated else 0.0,
                                               a.steps if emulated else a.real_steps)
    m = a.microbatches
    ideal_ms = m * (a.layers // STAGES) * 3 * a.layer_ms  # emulated: every stage busy all the time
    print(f"\nPP{STAGES}, m = {m} micro-batches, {a.layers} layers (hidden {a.hidden}, seq {a.seq}), "
          f"{a.real_steps} (real) / {a.steps} (emulated) timed steps x {a.repeats} runs, {os.cpu_count()} CPU cores; "
          f"emulated: {a.layer_ms} ms forward + {2 * a.layer_ms} ms backward per layer\n")
    print("| compute | schedule | v | median step (ms) | vs 1F1B | theoretical bubble | measured bubble |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        base = statistics.median(samples[mode, chunks[0]]) if chunks[0] == 1 else None
        for v in chunks:
            step_ms = 1000 * statistics.median(samples[mode, v])
            ratio = f"{base * 1000 / step_ms:.2f}x" if base is not None else "-"
            measured = f"{step_ms / ideal_ms - 1:.1%}" if mode == "emulated" else "-"
            print(f"| {mode} | {'1F1B' if v == 1 else 'interleaved'} | {v} | {step_ms:.0f} | {ratio} | "
                  f"{(STAGES - 1) / (v * m):.1%} | {measured} |")


if __name__ == "__main__":
    main()
