"""Train pretrain_gpt.py in-process on N gloo ranks and collect losses and full (re-assembled) weights."""
from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from megatron.core import parallel_state as ps
from tests.dist_utils import run_distributed

TINY_GPT = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "10", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--distributed-backend", "gloo", "--log-interval", "5", "--eval-iters", "0", "--num-workers", "0",
            "--seed", "1234"]

LLAMA_STYLE = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-query-groups", "2"]


def _global_name(name: str, pp_rank: int, pp: int, layers: int, chunks: int = 1) -> str:
    """A stage-local name with its layer index made global; under virtual pipeline stages the name starts with
    ``chunks.<k>.`` and chunk k of stage r holds the (k * pp + r)-th slice of the layers."""
    chunk = re.match(r"chunks\.(\d+)\.(.*)", name)
    k, name = (int(chunk.group(1)), chunk.group(2)) if chunk else (0, name)
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        per_chunk = layers // (pp * chunks)
        return f"decoder.layers.{(k * pp + pp_rank) * per_chunk + int(m.group(1))}.{m.group(2)}"
    return name


def _train_rank(rank: int, world: int, argv: list[str]) -> dict:
    from pretrain_gpt import main

    result = main(argv)
    model = getattr(result.model, "module", result.model)
    layers = int(argv[argv.index("--num-layers") + 1])
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    chunks = len(model.chunks) if hasattr(model, "chunks") else 1  # the interleaved schedule's model chunks
    weights = result.backend.local_state_dict()
    params, shared = {}, None
    for name, p in model.named_parameters():
        if getattr(p, "shared", False):
            shared = weights[name]  # the last stage's copy of the tied embedding; checked equal separately
            continue
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        expert_dim = getattr(p, "expert_partition_dim", None)  # MoE: EP ranks hold consecutive expert blocks
        params[_global_name(name, pp_rank, pp, layers, chunks)] = (weights[name], dim, expert_dim)
    if shared is None and model.shared_embedding_weight() is not None:
        shared = weights[("chunks.0." if chunks > 1 else "") + "embedding.word_embeddings.weight"]
    # Persistent buffers (the MoE routers' expert bias): replicated like the dense weights, compared like them.
    param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, buf in model.state_dict().items():
        if name not in param_names:
            params[_global_name(name, pp_rank, pp, layers, chunks)] = (buf.detach().float().clone(), None, None)
    return {"losses": result.losses, "lrs": result.lrs, "offloaded": result.offloaded_bytes, "params": params,
            "tp": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "cp": ps.get_context_parallel_rank(), "pp": pp_rank, "shared": shared,
            "ep": ps.get_expert_model_parallel_rank(), "ep_size": ps.get_expert_model_parallel_world_size()}


def train(argv: list[str], world: int, timeout: float = 300, rank_fn=None
          ) -> tuple[dict[int, float], dict[str, torch.Tensor], list]:
    """Returns (losses by iteration, full weights by global name, raw per-rank outputs). ``rank_fn(rank, world,
    argv)``: a module-level stand-in for ``_train_rank`` (which it may wrap) returning at least its keys."""
    outs = run_distributed(rank_fn or _train_rank, world, argv, timeout=timeout)
    losses = next(o["losses"] for o in outs if o["losses"])
    for o in outs:  # every last-stage rank reports the same DP-averaged loss
        if o["losses"]:
            assert o["losses"] == losses
    full: dict[str, torch.Tensor] = {}
    tp_size = max(o["tp"] for o in outs) + 1
    ep_size = outs[0].get("ep_size", 1)
    for name in {n for o in outs for n in o["params"]}:
        holders = [o for o in outs if name in o["params"]]
        expert_dim = holders[0]["params"][name][2]
        by_ep: dict[int, torch.Tensor] = {}  # expert-parallel rank -> its block (everything else: rank 0)
        for replica in sorted({(o["dp"], o["cp"]) for o in holders}):  # context-parallel ranks are replicas too
            shards = sorted((o for o in holders if (o["dp"], o["cp"]) == replica), key=lambda o: o["tp"])
            tensor, dim, _ = shards[0]["params"][name]
            if dim is None:
                for s in shards[1:]:  # replicated across TP ranks: must agree
                    torch.testing.assert_close(s["params"][name][0], tensor, rtol=0, atol=0)
            else:
                assert len(shards) == tp_size
                tensor = torch.cat([s["params"][name][0] for s in shards], dim=dim)
            ep = shards[0]["ep"] if expert_dim is not None else 0
            assert all(s["ep"] == shards[0]["ep"] for s in shards)  # TP ranks of one DP rank share the experts
            if ep in by_ep:  # data-parallel replicas (expert-data-parallel ones for experts) must agree
                torch.testing.assert_close(tensor, by_ep[ep], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
            by_ep[ep] = tensor
        if expert_dim is None:
            full[name] = by_ep[0]
        else:  # expert-parallel ranks hold consecutive blocks of the experts: join them in EP order
            assert sorted(by_ep) == list(range(ep_size)), (name, sorted(by_ep))
            full[name] = torch.cat([by_ep[e] for e in range(ep_size)], dim=expert_dim)
    return losses, full, outs


@functools.lru_cache(maxsize=None)
def reference(extra: tuple[str, ...]):
    """The single-process run of TINY_GPT + extra (cached): (losses, full weights, outputs)."""
    return train(TINY_GPT + list(extra), 1)


def assert_same_training(losses: dict[int, float], params: dict[str, torch.Tensor], ref_losses: dict[int, float],
                         ref_params: dict[str, torch.Tensor], iterations=range(1, 11), what: str = "") -> None:
    """The losses of ``iterations`` and the final weights (and persistent buffers) equal the reference's within
    1e-5."""
    assert sorted(losses) == list(iterations), what
    for it in iterations:
        assert losses[it] == pytest.approx(ref_losses[it], rel=1e-5), f"{what} iteration {it}"
    assert params.keys() == ref_params.keys(), what
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def check_matches_reference(extra: list[str], mesh: list[str], world: int) -> list:
    """Train TINY_GPT + extra on ``mesh`` (``world`` ranks): losses and weights equal one process's within 1e-5.
    Returns the per-rank outputs."""
    ref_losses, ref_params, _ = reference(tuple(extra))
    losses, params, outs = train(TINY_GPT + extra + mesh, world)
    assert_same_training(losses, params, ref_losses, ref_params)
    assert ref_losses[10] < ref_losses[1]  # it did train
    # Tied embedding: the last stage's copy stays equal to the first stage's.
    for o in outs:
        if o["shared"] is not None:
            first = next(x for x in outs if x["pp"] == 0 and (x["tp"], x["dp"], x["cp"]) == (o["tp"], o["dp"], o["cp"]))
            torch.testing.assert_close(o["shared"], first["shared"], rtol=0, atol=0)
    return outs


MESHES = {
    "tp2": (["--tensor-model-parallel-size", "2"], 2),
    "pp2": (["--pipeline-model-parallel-size", "2"], 2),
    "dp2": ([], 2),
    "tp2pp2dp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 8),
}


def ds_config_flags(tmp_path, stage: int, offload: bool = False, nvme: bool = False) -> list[str]:
    """``--deepspeed --deepspeed_config FILE`` for a small ZeRO config written under ``tmp_path``."""
    zero = {"stage": stage, "allgather_bucket_size": 3000, "stage3_param_persistence_threshold": 64,
            "sub_group_size": 5000}
    if offload or nvme:
        device = {"device": "nvme", "nvme_path": str(tmp_path / "swap")} if nvme else {"device": "cpu"}
        zero["offload_optimizer"] = dict(device)
        zero["offload_param"] = dict(device)
    path = tmp_path / f"ds_stage{stage}{'_offload' if offload else ''}{'_nvme' if nvme else ''}.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return ["--deepspeed", "--deepspeed_config", str(path)]
