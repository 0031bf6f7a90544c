"""The planner's activation memory (ptm_planner/activations.py) and --longest-seq: how the bytes scale with
sequence and context parallelism, recompute, offload and the interleaved schedule; that the formula is the bytes
this trainer's model keeps from its forward for its backward (a tiny GPT, one process); and that --longest-seq
answers a length whose plan fits and whose next step does not, printed and written as flags the trainer takes."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import parallel_state as ps
from megatron.core.transformer_config import TransformerConfig
from ptm_planner.activations import (
    ActivationSetup,
    activation_memory,
    in_flight_chunks,
    layer_bytes,
    layer_input_bytes,
    residual_side_bytes,
)
from ptm_planner.cli import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_FITS, main, request_from_args
from ptm_planner.longest_seq import seq_step
from ptm_planner.plan import Planner, with_seq

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=4096, padded_vocab_size=8192,
             attention_dropout=0.0)
CPU_BOX = ["--device", "cpu", "--nproc-per-node", "2", "--host-memory-gib", "4", "--nvme-free-gib", "20"]
GPU_NODE = ["--device", "cuda", "--device-memory-gib", "16", "--host-memory-gib", "256", "--nvme-free-gib", "500",
            "--nproc-per-node", "8", "--bf16"]
SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--vocab-size", "8191",
         "--attention-dropout", "0"]


def _memory(cfg: TransformerConfig, layers: int = 4, **kw):
    return activation_memory(cfg, ActivationSetup(seq_length=cfg.seq_length, micro_batch=1, **kw), layers)


# ---- how the bytes scale ------------------------------------------------------------------------------
def test_sequence_parallelism_divides_the_residual_side_by_tp():
    cfg = TransformerConfig(**SHAPE)
    plain = ActivationSetup(seq_length=4096, micro_batch=1, tp=4)
    sp = dataclasses.replace(plain, sequence_parallel=True)
    side = residual_side_bytes(cfg, plain) * plain.tokens
    assert side > 0 and residual_side_bytes(cfg, sp) * sp.tokens == side / 4
    assert layer_bytes(cfg, plain) - layer_bytes(cfg, sp) == side * 3 / 4  # the rest (TP-split already) unchanged
    assert layer_input_bytes(cfg, sp) == layer_input_bytes(cfg, plain) / 4


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_context_parallelism_divides_everything_per_rank_by_cp(comm):
    """With flash-style attention a token costs the same whatever the length, so CP 2 at 2s is CP 1 at s, but
    for the attention's output, which both kinds of context-parallel attention keep twice (in their layout and
    the projection's)."""
    cfg = TransformerConfig(**SHAPE)
    half = dataclasses.replace(cfg, seq_length=2048, max_position_embeddings=2048)
    one, two = _memory(half), _memory(cfg, cp=2, cp_comm_type=comm)
    output = 4 * 2048 * 256 * 4  # 4 layers of 2048 tokens, h fp32 elements a token
    assert (two.saved - output, two.logits) == (one.saved, one.logits)
    assert _memory(cfg, cp=2, cp_comm_type=comm).device / _memory(cfg).device == pytest.approx(0.5, rel=0.05)


def test_full_recompute_keeps_only_the_layer_inputs():
    cfg = TransformerConfig(**SHAPE)
    none, full = _memory(cfg), _memory(cfg, recompute="full")
    setup = ActivationSetup(seq_length=4096, micro_batch=1)
    assert none.saved - full.saved == 4 * (layer_bytes(cfg, setup) - 4096 * 256 * 4)
    assert full.working > none.working  # one layer rebuilt for its backward
    two = _memory(dataclasses.replace(cfg, recompute_num_layers=2), recompute="full")
    assert full.saved - two.saved == 2 * 4096 * 256 * 4  # blocks of two layers: half the inputs


def test_selective_recompute_drops_the_attention_scores_of_the_math_kernel():
    """On the CPU with attention dropout, the math kernel keeps three fp32 [s, s] tensors per head and layer;
    selective recompute keeps the core's inputs instead, whatever the length."""
    cfg = dataclasses.replace(TransformerConfig(**SHAPE), attention_dropout=0.1)
    none, selective = _memory(cfg), _memory(cfg, recompute="selective")
    assert none.saved - selective.saved > 4 * 3 * 8 * 4096 * 4096 * 4 * 0.9
    flash = _memory(TransformerConfig(**SHAPE), recompute="selective")
    assert selective.saved == flash.saved  # the same inputs whichever kernel runs


def test_offload_moves_layers_to_the_host():
    cfg = TransformerConfig(**SHAPE)
    setup = ActivationSetup(seq_length=4096, micro_batch=1)
    per_layer = layer_bytes(cfg, setup)
    none, two = _memory(cfg), _memory(cfg, offloaded_layers=2)
    assert two.host == int(2 * per_layer)
    # One micro-batch in flight: its last two layers on the device, then the first two back for their backward.
    assert none.saved - two.saved == pytest.approx(2 * per_layer, abs=1)
    pipelined = dict(pp=4, stage=0)  # 4 micro-batches in flight, each with its last layer on the device, and two
    on_host = _memory(cfg, offloaded_layers=3, **pipelined)  # layers back for the backward of the last of them
    assert on_host.host == int(4 * 3 * per_layer)
    assert _memory(cfg, **pipelined).saved - on_host.saved == pytest.approx((16 - (3 * 1 + 2)) * per_layer, abs=1)
    assert _memory(cfg, offloaded_layers=-1, **pipelined).host == on_host.host  # all but the chunk's last


def test_interleaved_schedule_holds_megatrons_share_of_micro_batches():
    """Stage 0 of PP 4 with 2 model chunks: 2 x 3 + 1 x 4 + 1 = 11 chunks, (1 + 3 / 8) x 4 stages' worth."""
    assert in_flight_chunks(4, 0, 2) == 11 and 11 / 2 == (1 + 3 / 8) * 4
    assert in_flight_chunks(4, 0) == 4 and in_flight_chunks(4, 3) == 1 and in_flight_chunks(4, 3, 2) == 5
    cfg = TransformerConfig(**SHAPE)
    plain, interleaved = _memory(cfg, pp=4), _memory(cfg, pp=4, virtual_stages=2)
    per_layer = layer_bytes(cfg, ActivationSetup(seq_length=4096, micro_batch=1))
    embedding = 4096 * (8 + 256 * 4)  # token ids and dropout mask: 6 first-chunk micro-batches in flight, not 4
    assert interleaved.saved - plain.saved == pytest.approx((11 * 2 - 4 * 4) * per_layer + 2 * embedding, abs=1)


# ---- the formula against the model ------------------------------------------------------------------------
class _Allocations(TorchDispatchMode):
    """Every storage an op makes (CPU), weakly, so what is still alive afterwards can be summed."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                known = self.made.get(storage.data_ptr())
                if known is None or known[0].expired():  # an address freed and reused
                    self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self, besides: set[int]) -> int:
        gc.collect()
        return sum(n for ptr, (ref, n) in self.made.items() if not ref.expired() and ptr not in besides)


@contextlib.contextmanager
def _one_rank_of(tp: int, cp: int):
    """This process as the last rank of a TP x CP mesh (the planner plans the largest: under all-gather context
    parallelism CP rank 0 alone has a chunk without a mask): gloo for one rank; torch's fake group (collectives
    do nothing, shapes are real) for more."""
    if tp * cp == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
        dist.init_process_group("fake", store=dist.HashStore(), rank=tp * cp - 1, world_size=tp * cp)
    try:
        ps.initialize_model_parallel(tp, 1, **({"context_parallel_size": cp} if cp > 1 else {}))
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _kept_after_forward(cfg: TransformerConfig, batch: int) -> tuple[int, int]:
    """(bytes alive after a training forward with the loss, bytes autograd's saved-tensor hooks saw) of a GPT
    on ``cfg.seq_length`` tokens a sample, besides its parameters and the positions (made before, shared by the
    batch)."""
    from megatron.model.gpt_model import GPTModel

    torch.manual_seed(0)
    model = GPTModel(cfg).train()
    positions = torch.arange(cfg.seq_length).expand(batch, cfg.seq_length)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {positions.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    made = _Allocations()
    with made, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = torch.randint(0, cfg.padded_vocab_size, (batch, cfg.seq_length))
        loss = model(tokens, positions, labels=tokens)
    kept = made.alive(params)
    del loss
    return kept, sum(saved.values())


TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=48, padded_vocab_size=256)
MODELS = {
    "gpt2": {},
    "no dropout": dict(hidden_dropout=0.0, attention_dropout=0.0),
    "math attention": dict(attention_dropout=0.1),
    "llama-gqa": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                      add_bias_linear=False, attention_dropout=0.0),
    "rope": dict(position_embedding_type="rope", attention_dropout=0.0),
    "bf16": dict(precision="bf16", attention_dropout=0.0),
    "bf16 rmsnorm": dict(precision="bf16", normalization="RMSNorm", attention_dropout=0.0),
    "full recompute": dict(recompute_granularity="full", attention_dropout=0.0),
    "full recompute, blocks of 2": dict(recompute_granularity="full", recompute_num_layers=2),
    "block recompute": dict(recompute_granularity="full", recompute_method="block", attention_dropout=0.0),
    "selective recompute": dict(recompute_granularity="selective", attention_dropout=0.1),
    "sequence parallel": dict(sequence_parallel=True, attention_dropout=0.0),
    "llama sequence parallel": dict(sequence_parallel=True, position_embedding_type="rope", normalization="RMSNorm",
                                    swiglu=True, num_query_groups=2, add_bias_linear=False, attention_dropout=0.0),
}


MESHES = {"one rank": (1, 1, "p2p"), "tp2": (2, 1, "p2p"), "cp2 ring": (1, 2, "p2p"), "cp2 ulysses": (1, 2, "a2a"),
          "cp2 allgather": (1, 2, "allgather"), "tp2 cp2": (2, 2, "p2p")}


def _built(kw: dict, cp: int, comm: str) -> TransformerConfig:
    """The tiny GPT with ``kw``, or a skip where the trainer's model does not have the feature yet."""
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    if cp > 1:
        if "context_parallel_size" not in inspect.signature(ps.initialize_model_parallel).parameters:
            pytest.skip("the trainer does not implement context parallelism yet")
        if comm in ("p2p", "allgather") and kw.get("attention_dropout", 0.1) > 0:
            pytest.skip(f"--cp-comm-type {comm} takes no attention dropout (the trainer refuses it)")
        kw = {**kw, "cp_comm_type": comm}
    missing = [k for k in kw if k not in fields]
    if missing:
        pytest.skip(f"TransformerConfig has no {', '.join(missing)} (the trainer does not implement it yet)")
    if kw.get("recompute_granularity") == "selective":
        from megatron.model import transformer
        if "selective" not in inspect.getsource(transformer):
            pytest.skip("the trainer's model does not implement selective recompute yet")
    return TransformerConfig(**TINY, **kw)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", list(MODELS))
def test_formula_is_what_the_model_keeps_for_the_backward(name, mesh):
    """After a training forward a tiny GPT holds exactly what activation_memory saves, plus the loss's softmax
    (4 bytes per logit of the rank, part of the logits' peak) and the per-token loss (4 bytes a token)."""
    kw, (tp, cp, comm) = MODELS[name], MESHES[mesh]
    if kw.get("sequence_parallel") and tp == 1:
        pytest.skip("sequence parallelism splits over TP ranks")
    cfg, batch = _built(kw, cp, comm), 2
    local = dataclasses.replace(cfg, seq_length=cfg.seq_length // cp)  # a CP rank's part of every sequence
    with _one_rank_of(tp, cp):
        kept, hooked = _kept_after_forward(local, batch)
    setup = ActivationSetup(seq_length=cfg.seq_length, micro_batch=batch, tp=tp, cp=cp, cp_comm_type=comm,
                            sequence_parallel=kw.get("sequence_parallel", False),
                            recompute=kw.get("recompute_granularity"))
    mem = activation_memory(cfg, setup, layers=2)
    tokens = setup.tokens
    assert kept == mem.saved + tokens * cfg.padded_vocab_size // tp * 4 + tokens * 4
    if "recompute_granularity" not in kw:  # autograd saves all of it (recompute keeps the inputs itself) but the
        # loss and, with TP, the token ids (the embedding saves the rank's local ids)
        assert hooked == kept - tokens * 4 - (tokens * 8 if tp > 1 else 0)


# ---- --longest-seq ------------------------------------------------------------------------------------------
def _json(argv: list[str], capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [
    SMALL + CPU_BOX,
    SMALL + GPU_NODE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"],
    SMALL + GPU_NODE + ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--recompute-granularity",
                        "selective", "--offload", "none"],
    SMALL + GPU_NODE + ["--context-parallel-size", "4", "--cp-comm-type", "allgather"],
], ids=["cpu", "gpu tp2 sp cp2", "gpu cp4 a2a selective", "gpu cp4 allgather"])
def test_longest_seq_fits_and_the_next_step_does_not(argv, capsys):
    code, plan = _json(argv + ["--longest-seq"], capsys)
    longest = plan["longest_seq"]
    assert code == EXIT_FITS and plan["fits"] and plan["model"]["seq_length"] == longest
    request, _ = request_from_args(argv)
    step = seq_step(request.mesh, request.layout)
    assert step == 2 * request.mesh.cp * request.mesh.tp and longest % step == 0 and longest > 1024
    assert Planner(with_seq(request, longest)).feasible()
    assert not Planner(with_seq(request, longest + step)).feasible()


def test_longest_seq_is_printed_and_written_as_flags_the_trainer_takes(tmp_path, capsys):
    from megatron.training.arguments import parse_args
    from megatron.training.config import ConfigError

    written = tmp_path / "args.txt"
    argv = SMALL + GPU_NODE + ["--num-layers", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--context-parallel-size", "2", "--cpu-offloading-num-layers", "1",
                               "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                               "--micro-batch-size", "1"]
    capsys.readouterr()
    assert main(argv + ["--longest-seq", "--write-args", str(written)]) == EXIT_FITS
    out = capsys.readouterr().out
    code, plan = _json(argv + ["--longest-seq"], capsys)
    longest = plan["longest_seq"]
    assert f"the longest sequence that fits: --seq-length {longest} (the next multiple of 8 does not)" in out
    assert "TP 2 (sequence-parallel) CP 2 (p2p) PP 2 (2 model chunks each) DP 1" in out
    words = written.read_text().split("\n")[:-1]
    assert words[words.index("--seq-length") + 1] == words[words.index("--max-position-embeddings") + 1] == str(longest)
    for flags in (["--sequence-parallel"], ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
                  ["--cpu-offloading", "--cpu-offloading-num-layers", "1"], ["--attention-dropout", "0"],
                  ["--num-layers-per-virtual-pipeline-stage", "2"]):
        at = words.index(flags[0])
        assert words[at:at + len(flags)] == flags, words
    stage = plan["stages"][0]["nonstate"]
    assert stage["offloaded"] > 0 and plan["stages"][0]["need"]["host"] >= stage["offloaded"]
    try:
        # 2 micro-batches a step: the interleaved schedule takes a multiple of PP
        cfg = parse_args(words + ["--train-iters", "1", "--lr", "1e-4", "--mock-data", "--global-batch-size", "2"],
                         world_size=8)
    except ConfigError as e:
        if "unknown flag" not in str(e):
            raise
        pytest.skip(f"pretrain_gpt.py does not take the long-context flags yet ({e})")
    par = cfg.parallel
    assert (cfg.model.seq_length, par.context_parallel_size, par.sequence_parallel) == (longest, 2, True)


def test_nothing_fits_at_the_shortest_length_is_one_line(capsys):
    code = main(SMALL + ["--hidden-size", "8192", "--num-attention-heads", "64"] + CPU_BOX + ["--longest-seq"])
    out, err = capsys.readouterr()
    assert code == EXIT_DOES_NOT_FIT and out == ""
    assert err.startswith("plan_memory.py: nothing of this family fits: --seq-length 2 of this model (")


@pytest.mark.parametrize("extra, message", [
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"],
     "with --cp-comm-type p2p (its block kernels take no dropout)"),
    (["--context-parallel-size", "2", "--seq-length", "1030"], "--seq-length 1030 is not divisible by 4"),
    (["--context-parallel-size", "3"], "context-parallel size 3"),
    (["--cpu-offloading-num-layers", "4"], "so 1 to 3 can be offloaded"),
    (["--largest", "--longest-seq"], "ask for one at a time"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "must divide the layers per pipeline stage"),
])
def test_bad_long_context_flags_are_one_clear_error(extra, message, capsys):
    assert main(SMALL + CPU_BOX + ["--seq-length", "1024"] + extra) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_plan_reports_the_layout(capsys):
    code, plan = _json(SMALL + CPU_BOX + ["--seq-length", "2048", "--recompute-granularity", "selective"], capsys)
    assert code == EXIT_FITS and plan["layout"]["granularity"] == "selective"
    words = plan["megatron_args"]
    assert words[words.index("--recompute-granularity") + 1] == "selective"
