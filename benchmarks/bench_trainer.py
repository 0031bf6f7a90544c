"""Trainer throughput against a plain PyTorch loop of the same GPT, and the machine's matmul peak.

    python -m benchmarks.bench_trainer [--layers 12 --hidden 768 --heads 12 --seq 256 --mbs 4 --steps 4]

Both run in this one process (one rank, fp32 on CPU, bf16 on CUDA) on the same
synthetic tokens. "ours" is pretrain_gpt.py's full loop (schedule, DDP buffer,
optimizer wrapper, scheduler, logging); "plain" is forward + backward + fused
AdamW and nothing else, i.e. the overhead-free bound for this model. MFU is
model TFLOP/s over the measured matmul peak.
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 5, trials: int = 5) -> float:
    """Best of several timed square matmuls (TFLOP/s): the ceiling MFU is measured against."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12)
    return best


def model_argv(a) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.mbs),
            "--global-batch-size", str(a.mbs), "--train-iters", str(a.steps + 1), "--lr", "1e-4",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0"] + (["--bf16"] if torch.cuda.is_available() else [])


def run_ours(a) -> float:
    """Tokens/s of pretrain_gpt.py, timing every iteration but the first (warm-up)."""
    from megatron.training import train_log
    from pretrain_gpt import main

    times = []
    original = train_log.TrainLogger.log

    def timed_log(self, iteration, *args, **kwargs):
        times.append(time.perf_counter())
        return original(self, iteration, *args, **kwargs)

    train_log.TrainLogger.log = timed_log
    try:
        main(model_argv(a))
    finally:
        train_log.TrainLogger.log = original
    return a.mbs * a.seq * (len(times) - 1) / (times[-1] - times[0])


def run_plain(a) -> float:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer_config import TransformerConfig
    from megatron.model.gpt_model import GPTModel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            seq_length=a.seq, padded_vocab_size=-(-(a.vocab + 1) // 128) * 128,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            precision="bf16" if device.type == "cuda" else "fp32")
    model = GPTModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    pos = torch.arange(a.seq, device=device).expand(a.mbs, a.seq)
    g = torch.Generator().manual_seed(0)
    stamps = []
    for _ in range(a.steps + 1):
        tokens = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), generator=g).to(device)
        loss = model(tokens[:, :-1], pos, labels=tokens[:, 1:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    return a.mbs * a.seq * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    from megatron.core.transformer_config import TransformerConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            seq_length=a.seq, padded_vocab_size=-(-(a.vocab + 1) // 128) * 128)
    peak = matmul_peak(device, dtype)
    ours = run_ours(a)  # initialises torch.distributed (world of one) and the mesh
    plain = run_plain(a)
    peak = max(peak, matmul_peak(device, dtype))  # again after the runs: the machine may have been busier before
    flops = cfg.flops_per_token()
    print(f"\nGPT {cfg.num_parameters() / 1e6:.1f}M params, seq {a.seq}, micro-batch {a.mbs}, "
          f"{'bf16 on ' + torch.cuda.get_device_name() if cuda else 'fp32 on CPU'}, "
          f"{torch.get_num_threads()} threads; matmul peak {peak:.3f} TFLOP/s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"| {'system':<22} | {'tokens/s':>10} | {'TFLOP/s':>8} | {'MFU':>6} | {'vs plain':>8} |")
    print(f"|{'-' * 24}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 10}|")
    for name, tps in (("ours (pretrain_gpt.py)", ours), ("plain PyTorch loop", plain)):
        tf = tps * flops / 1e12
        print(f"| {name:<22} | {tps:10.1f} | {tf:8.3f} | {tf / peak:6.1%} | {tps / plain:8.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    main()
