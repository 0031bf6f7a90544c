"""Long-context training on GPUs: activation offload on CUDA copy streams and selective recompute change nothing
(one GPU), and sequence and context parallelism over NCCL train like one GPU (two GPUs)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.cuda.common import gpu_only, strict_fp32
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import LLAMA_STYLE, TINY_GPT

pytestmark = gpu_only()

RANK_TIMEOUT = 600
# Wide enough that every saved activation passes the offloader's 64 KiB minimum; the math attention kernel is
# deterministic, so two runs can be compared bit for bit.
WIDE = LLAMA_STYLE + ["--hidden-size", "128", "--seq-length", "128", "--max-position-embeddings", "128",
                      "--attention-backend", "unfused", "--log-interval", "1"]


def _argv(extra: list[str]) -> list[str]:
    argv = list(TINY_GPT) + WIDE + extra
    argv[argv.index("--distributed-backend") + 1] = "nccl"
    return argv


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    strict_fp32()
    from pretrain_gpt import main

    result = main(argv)
    weights = result.backend.local_state_dict()
    return {"losses": result.losses, "weights": {k: v.cpu() for k, v in weights.items()},
            "offloaded": result.offloaded_bytes}


def _zero3(tmp_path) -> list[str]:
    ds = tmp_path / "ds_zero3_offload.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "allgather_bucket_size": 30000, "stage3_param_persistence_threshold": 64,
        "sub_group_size": 50000, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}}))
    return ["--deepspeed", "--deepspeed_config", str(ds)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_activation_offload_and_selective_recompute_on_gpu_change_nothing(tmp_path, backend):
    base = _argv(_zero3(tmp_path) if backend == "zero3" else [])
    plain = run_distributed(_train, 1, base, backend="nccl", timeout=RANK_TIMEOUT)[0]
    changed = run_distributed(_train, 1, base + ["--cpu-offloading", "--recompute-granularity", "selective"],
                              backend="nccl", timeout=RANK_TIMEOUT)[0]
    # every step moved activations over the copy streams
    assert sorted(changed["offloaded"]) == list(range(1, 11)) and min(changed["offloaded"].values()) > 0
    assert changed["losses"] == plain["losses"]
    for name, ref in plain["weights"].items():
        assert torch.equal(changed["weights"][name], ref), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("split", ["tp2-sp", "cp2-p2p", "cp2-a2a", "cp2-allgather"])
def test_sequence_and_context_parallel_over_nccl_match_one_gpu(split):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL runs one rank per GPU)")
    flags = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
             "cp2-p2p": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
             "cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
             "cp2-allgather": ["--context-parallel-size", "2", "--cp-comm-type", "allgather"]}[split]
    one = run_distributed(_train, 1, _argv([]), backend="nccl", timeout=RANK_TIMEOUT)[0]
    two = run_distributed(_train, 2, _argv(flags), backend="nccl", timeout=RANK_TIMEOUT)
    losses = next(r["losses"] for r in two if r["losses"])
    for it, ref in one["losses"].items():
        assert losses[it] == pytest.approx(ref, rel=1e-4), f"{split} iteration {it}"
