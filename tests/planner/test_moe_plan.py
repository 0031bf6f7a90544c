"""The planner on mixtures of experts: total against active parameters, the expert states each rank holds per
tier (ZeRO-sharded over the expert-data-parallel group), the all-to-all volume, MoE activations, --largest
growing layers or experts, the start.sh MoE sizes, and flags the trainer takes; numbers worked out by hand."""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from megatron.core.moe.config import MoEConfig
from megatron.core.transformer_config import TransformerConfig
from ptm_planner.cli import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_FITS, main, request_from_args
from ptm_planner.non_state import layer_activation_bytes, reduce_result_bytes
from ptm_planner.plan import Option, Planner, with_experts, with_layers
from ptm_planner.sizes import SIZES, get_size

# 4 layers, hidden 64, SwiGLU without biases; every MLP is 8 experts of ffn 32, top-2. Vocabulary 101 padded to
# 128, 16 learned positions.
FAMILY = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
          "--vocab-size", "101", "--make-vocab-size-divisible-by", "64", "--swiglu", "--disable-bias-linear",
          "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--micro-batch-size", "2"]
MOE = ["--num-layers", "4", *FAMILY]
BOX = ["--device", "cpu", "--host-memory-gib", "24", "--nvme-free-gib", "70"]
ATTENTION = 64 * 192 + 64 * 64  # QKV and the output projection
NORMS = 2 * 2 * 64  # two LayerNorms, weight and bias
EXPERT = 3 * 64 * 32  # fc1, its gate and fc2 of one expert
ROUTER = 8 * 64
EMBEDDINGS = 128 * 64 + 16 * 64 + 2 * 64  # words, positions, final norm
TOTAL = 4 * (ATTENTION + NORMS + 8 * EXPERT + ROUTER) + EMBEDDINGS  # 274,560
ACTIVE = 4 * (ATTENTION + NORMS + 2 * EXPERT + ROUTER) + EMBEDDINGS  # 127,104


def _plan(argv: list[str], capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def _mesh(dp: int, ep: int) -> list[str]:
    return ["--nproc-per-node", str(dp), "--expert-model-parallel-size", str(ep)]


def test_total_and_active_parameters_are_the_models(capsys):
    code, plan = _plan(MOE + BOX + _mesh(4, 2), capsys)
    request, _ = request_from_args(MOE + BOX + _mesh(4, 2))
    assert code == EXIT_FITS
    assert (TOTAL, ACTIVE) == (274_560, 127_104)
    assert plan["model"]["num_parameters"] == request.model.num_parameters() == TOTAL
    assert plan["model"]["num_parameters_active"] == request.model.num_parameters(active=True) == ACTIVE
    (stage,) = plan["stages"]
    # One rank holds 4 of the 8 experts of each layer (EP 2) and everything else.
    assert stage["expert_parameters"] == 4 * 4 * EXPERT == 98_304
    assert stage["parameters"] == TOTAL - 4 * 4 * EXPERT
    # Per token it computes with 2 experts per layer: the model's active parameters.
    assert stage["active_parameters"] == ACTIVE
    assert stage["moe_layers"] == 4
    assert plan["mesh"]["expert_data_parallel_size"] == 2


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_states_are_16_bytes_per_expert_parameter_the_rank_holds_after_zero(ep, capsys):
    """fp32 without offload: parameter, gradient and two Adam moments, 4 bytes each, of the rank's shard. The
    rank holds E / EP experts, sharded over DP / EP ranks: E x P / DP expert parameters whatever EP is."""
    code, plan = _plan(MOE + BOX + _mesh(4, ep) + ["--offload", "none"], capsys)
    assert code == EXIT_FITS and plan["option"]["offload"] == "none"
    (stage,) = plan["stages"]
    held = 4 * (8 // ep) * EXPERT
    assert stage["expert_parameters"] == held  # 1/EP of the experts ...
    shard = held // (4 // ep)
    assert shard == 4 * 8 * EXPERT // 4 == 49_152  # ... and 1/DP of the experts after ZeRO, for every EP
    assert stage["expert_states_by_tier"] == {"device": 16 * shard, "host": 0, "nvme": 0}
    assert stage["states"]["params/device"] >= 4 * shard and stage["states_by_tier"]["device"] > 16 * shard


def test_expert_states_follow_the_offload_to_their_tier():
    """The engine's placement of the expert chunks: host memory with CPU offload, SSD with NVMe offload (their
    gradient shards may stay on the host), split with the device by prefetch_cache_sub_group_rate."""
    request, _ = request_from_args(MOE + BOX + _mesh(4, 2))
    planner = Planner(request)
    page = planner.pages[-1]  # one matrix per chunk: sub-groups small enough to split between tiers
    size = planner.sub_group_sizes(page)[-1]

    def experts(offload: str, rate: float = 0.0) -> dict[str, int]:
        ev = planner.evaluate(Option(offload, page, 2, False, size, rate))
        assert ev.fits, ev.failures
        return ev.stages[0].states.expert_by_tier

    shard = 16 * 49_152
    assert experts("none") == {"device": shard, "host": 0, "nvme": 0}
    assert experts("cpu") == {"device": 0, "host": shard, "nvme": 0}
    on_ssd = experts("nvme")
    assert on_ssd["device"] == 0 and on_ssd["nvme"] >= 12 * 49_152 and on_ssd["host"] + on_ssd["nvme"] == shard
    split = experts("cpu", rate=0.5)
    assert split["device"] > 0 and split["host"] > 0 and split["device"] + split["host"] == shard


@pytest.mark.parametrize("ep, split_shard", [(2, 8192), (4, 4096)])
def test_reduce_results_that_miss_their_shard_are_planned_unless_the_group_is_one_rank(ep, split_shard):
    """A reduce-scatter result that misses its gradient shard (a shard on SSD, a later micro-batch) goes to one of
    2 kept buffers of the largest shard split over several ranks. One matrix per chunk (16,384 elements): with
    EP 2 the experts' group is 2 of the 4 ranks (8,192); with EP 4 = DP it is one rank, whose reduce buffer is
    its result, so the largest is a dense chunk's 16,384 / 4. The plan's reduce memory is 2 chunk buffers plus
    the larger of one chunk and those results."""
    request, _ = request_from_args(MOE + BOX + _mesh(4, ep))
    planner = Planner(request)
    page = planner.pages[-1]
    assert page == 16_384
    plans = planner.plans(page)[0]
    assert reduce_result_bytes(plans, 4) == 2 * split_shard * 4
    size = planner.sub_group_sizes(page)[-1]
    chunk = 16_384 * 4
    for offload in ("none", "nvme"):
        reduce = planner.evaluate(Option(offload, page, 2, False, size)).stages[0].nonstate.reduce_buffers
        assert reduce == 2 * chunk + max(chunk, 2 * split_shard * 4 if offload == "nvme" else 0)


@pytest.mark.parametrize("ep, exchange", [(1, 0), (2, 8192), (4, 12288)])
def test_all_to_all_volume(ep, exchange, capsys):
    """Per MoE layer and micro-batch 16 x 2 tokens x top-2 = 64 rows of 64 fp32 elements (16 KiB), of which
    (EP - 1) / EP go to other ranks, 4 times (dispatch and combine, forward and backward); 3 micro-batches a step,
    4 MoE layers; full recompute runs the forward's two again."""
    argv = MOE + BOX + _mesh(4, ep) + ["--gradient-accumulation-steps", "3"]
    code, plan = _plan(argv, capsys)
    assert code == EXIT_FITS and not plan["option"]["recompute"]
    traffic = plan["stages"][0]["all_to_all"]
    assert (traffic["rows"], traffic["exchange_bytes"]) == (64, exchange)
    assert traffic["step_bytes"] == exchange * 4 * 4 * 3
    code, plan = _plan(argv + ["--recompute-activations"], capsys)
    assert plan["stages"][0]["all_to_all"]["step_bytes"] == exchange * 6 * 4 * 3


def test_moe_layer_activations_count_the_routed_rows():
    """seq 16 x micro-batch 2, fp32: attention and the layer's own tensors as a dense layer (Korthikanti,
    without the MLP term: (s*b*h*18 + 5*a*s^2*b) x 2 bytes), plus per routed row its h inputs and the expert's
    2 x F x 2 hidden (SwiGLU), plus the router's fp32 logits and probabilities."""
    moe = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=32)
    cfg = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, padded_vocab_size=128,
                            swiglu=True, add_bias_linear=False, moe=moe)
    attention = (16 * 2 * 64 * 18 + 5 * 4 * 16 * 16 * 2) * 2
    router = 32 * 2 * 8 * 4
    assert layer_activation_bytes(cfg, 2, 1, moe=True) == attention + 64 * (64 + 128) * 4 + router == 145_408
    # A capacity factor bounds the rows whatever the routing: 8 experts x ceil(32 x 2 x 1.5 / 8) = 96.
    capped = dataclasses.replace(cfg, moe=dataclasses.replace(moe, capacity_factor=1.5))
    assert layer_activation_bytes(capped, 2, 1, moe=True) == attention + 96 * 192 * 4 + router
    # A shared expert adds a dense MLP's term of its width: 4 x S / h x 2 (SwiGLU) x s*b*h x 2 bytes.
    shared = dataclasses.replace(cfg, moe=dataclasses.replace(moe, shared_expert_intermediate_size=48))
    assert layer_activation_bytes(shared, 2, 1, moe=True) - layer_activation_bytes(cfg, 2, 1, moe=True) == \
        16 * 2 * 64 * 4 * 48 / 64 * 2 * 2


def test_gpu_step_prediction_computes_with_the_active_parameters(capsys):
    """moe-8x1.3b on 8 GPUs with EP 8: each rank holds 1 expert per layer, and computes per token with the
    model's 2.12B active parameters: the step's model FLOPs are 6 per active parameter and token plus causal
    attention's (6 x seq x hidden per layer and token), over 4 x 256 tokens a micro-batch on each of 8 ranks."""
    code, plan = _plan(["--size", "moe-8x1.3b", "--device", "cuda", "--device-memory-gib", "80", "--bf16",
                        "--host-memory-gib", "1024", "--nvme-free-gib", "3000", *_mesh(8, 8)], capsys)
    assert code == EXIT_FITS and plan["option"]["micro_batch_size"] == 4 and not plan["option"]["recompute"]
    (stage,) = plan["stages"]
    assert stage["active_parameters"] == plan["model"]["num_parameters_active"] == 2_117_603_328
    assert stage["expert_parameters"] == 24 * 2 * 2048 * 8192  # one expert of each layer
    pred = plan["step_prediction"]
    flops = pred["tflops_per_gpu"] * 1e12 * pred["step_s"] * 8
    assert flops == pytest.approx((6 * 2_117_603_328 + 6 * 256 * 2048 * 24) * 4 * 256 * 8)
    # bf16: 2-byte parameters, fp32 gradient, master and moments over 1 expert-data-parallel rank (DP 8 / EP 8).
    assert sum(stage["expert_states_by_tier"].values()) == 18 * stage["expert_parameters"]


def test_dense_and_moe_layers_of_a_layer_pattern_per_stage(capsys):
    """--moe-layer-freq [1,1,0,0] over 2 pipeline stages: the first holds two MoE layers, the second none."""
    argv = ["--num-layers", "4", *FAMILY, "--moe-layer-freq", "[1,1,0,0]", "--pipeline-model-parallel-size", "2",
            *BOX, *_mesh(4, 2)]
    code, plan = _plan(argv, capsys)
    assert code == EXIT_FITS
    first, last = plan["stages"]
    assert (first["moe_layers"], first["expert_parameters"]) == (2, 2 * 4 * EXPERT)
    assert (last["moe_layers"], last["expert_parameters"], last["expert_states_by_tier"]["device"]) == (0, 0, 0)
    assert last["all_to_all"]["step_bytes"] == 0
    assert "--moe-layer-freq" in plan["megatron_args"]
    assert plan["megatron_args"][plan["megatron_args"].index("--moe-layer-freq") + 1] == "[1,1,0,0]"


# A family whose expert states fill a 2-process, 6 GiB CPU node without offload: hidden 1024, ffn 1024 experts.
WIDE = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "64",
        "--vocab-size", "8192", "--num-experts", "4", "--moe-router-topk", "2", "--micro-batch-size", "1",
        "--moe-ffn-hidden-size", "1024", "--device", "cpu", "--host-memory-gib", "6", "--nvme-free-gib", "70",
        "--offload", "none", *_mesh(2, 2)]


def test_largest_by_experts_fits_and_the_next_expert_count_does_not(capsys):
    code, plan = _plan(WIDE + ["--largest", "--largest-by", "experts"], capsys)
    assert code == EXIT_FITS
    experts = plan["largest_experts"]
    assert experts == plan["model"]["moe"]["num_experts"] and experts % 2 == 0 and experts > 4
    assert plan["largest_parameters"] == plan["model"]["num_parameters"]
    request, _ = request_from_args(WIDE)
    assert Planner(with_experts(request, experts)).search().fits
    assert not Planner(with_experts(request, experts + 2)).search().fits  # the next count EP 2 splits evenly
    assert main(WIDE + ["--largest", "--largest-by", "experts"]) == EXIT_FITS
    assert f"the largest of this family that fits: --num-experts {experts} (" in capsys.readouterr().out


def test_largest_by_layers_for_a_mixture_of_experts(capsys):
    code, plan = _plan(WIDE + ["--largest"], capsys)
    assert code == EXIT_FITS
    layers = plan["largest_layers"]
    assert layers == plan["model"]["num_layers"] > 0 and plan["stages"][0]["moe_layers"] == layers
    request, _ = request_from_args(WIDE)
    assert Planner(with_layers(request, layers)).search().fits
    assert not Planner(with_layers(request, layers + 1)).search().fits


def test_sizes_table_has_mixtures_of_experts_that_start_sh_passes_on():
    counts = {}
    for name in ("moe-tiny", "moe-8x1.3b", "moe-64e"):
        size = get_size(name)
        request, _ = request_from_args(["--size", name, *BOX])
        moe = request.model.moe
        assert (moe.num_experts, moe.router_topk) == (size.num_experts, size.router_topk)
        assert size.megatron_args()[-len(size.moe_args()):] == size.moe_args()
        counts[name] = (round(request.model.num_parameters() / 1e9, 1),
                        round(request.model.num_parameters(active=True) / 1e9, 1))
    assert counts == {"moe-tiny": (0.0, 0.0), "moe-8x1.3b": (6.9, 2.1), "moe-64e": (11.2, 1.9)}
    assert get_size("moe-64e").moe_args() == ["--num-experts", "64", "--moe-router-topk", "6", "--moe-ffn-hidden-size",
                                              "1408", "--moe-shared-expert-intermediate-size", "2816",
                                              "--moe-aux-loss-coeff", "1e-2"]
    assert all(not s.moe_args() for s in SIZES if not s.name.startswith("moe-"))


def test_moe_size_that_cannot_fit_names_the_largest_moe_size_that_does(capsys):
    """The start.sh size named for an MoE request is an MoE size (a dense one is another kind of model)."""
    code, plan = _plan(["--size", "moe-8x1.3b", *BOX, "--nproc-per-node", "2"], capsys)
    assert code == EXIT_DOES_NOT_FIT
    assert plan["largest_size"] == "moe-tiny"
    assert plan["message"].startswith("does not fit: moe-8x1.3b GPT 6.95B parameters, 2.12B active (24 layers")
    assert Planner(request_from_args(["--size", "moe-tiny", *BOX, "--nproc-per-node", "2"])[0]).search().fits


def test_the_trainer_takes_the_planned_moe_flags(tmp_path, capsys):
    from megatron.training.arguments import parse_args

    args = tmp_path / "args.txt"
    argv = MOE + BOX + _mesh(4, 2) + ["--moe-expert-capacity-factor", "1.25", "--moe-shared-expert-intermediate-size",
                                      "48", "--moe-aux-loss-coeff", "0.01", "--write-args", str(args)]
    assert main(argv) == EXIT_FITS
    capsys.readouterr()
    request, _ = request_from_args(argv)
    words = args.read_text().split("\n")[:-1]
    cfg = parse_args(words + ["--train-iters", "1", "--lr", "1e-4", "--mock-data"], world_size=4)
    assert cfg.parallel.expert_model_parallel_size == 2
    assert cfg.model.moe == request.model.moe
    assert (cfg.model.moe.capacity_factor, cfg.model.moe.aux_loss_coeff) == (1.25, 0.01)


@pytest.mark.parametrize("argv, message", [
    (MOE + _mesh(4, 3), "--expert-model-parallel-size 3 must divide the data-parallel size 4"),
    (MOE + _mesh(4, 4) + ["--num-experts", "6"], "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (MOE + _mesh(4, 1) + ["--tensor-model-parallel-size", "2", "--moe-ffn-hidden-size", "33"],
     "--moe-ffn-hidden-size (33) is not divisible by tensor-parallel size (2)"),
    (["--size", "125m", *_mesh(4, 2)], "--expert-model-parallel-size 2 splits experts; give --num-experts"),
    (MOE + ["--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    (MOE + ["--moe-layer-freq", "[1,0]"], "--moe-layer-freq has 2 entries for --num-layers 4"),
    (MOE + ["--largest", "--moe-layer-freq", "[1,0,1,0]"], "a --moe-layer-freq list fixes the layer count"),
    (["--size", "125m", "--largest", "--largest-by", "experts"], "--largest-by experts grows a mixture of experts"),
])
def test_runs_the_trainer_would_refuse_are_bad_input(argv, message, capsys):
    """The planner says 'fits' only for runs that train: a mesh or MoE the trainer refuses is exit 2."""
    assert main(argv + BOX) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_fewest_experts_that_do_not_fit_is_one_line(capsys):
    code = main(WIDE + ["--host-memory-gib", "1", "--largest", "--largest-by", "experts"])
    out, err = capsys.readouterr()
    assert code == EXIT_DOES_NOT_FIT and out == ""
    assert err.startswith("plan_memory.py: nothing of this family fits: 2 experts per MoE layer (")


def test_the_docs_moe_examples_run_here(capsys):
    """docs/planner.md's MoE commands (hardware given, so on any machine): the first fits without offload, the
    second names the most experts that fit with host offload, and one more EP's worth does not."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text(encoding="utf-8")
    section = text[text.index("## Mixtures of experts"):text.index("## `examples/start.sh`")].replace("\\\n", " ")
    fits, most = [shlex.split(line, comments=True)[1:] for line in section.splitlines() if line.startswith("ptm-plan ")]
    code, plan = _plan(fits, capsys)
    assert code == EXIT_FITS and plan["option"]["offload"] == "none"
    code, plan = _plan(most, capsys)
    assert code == EXIT_FITS and plan["option"]["offload"] == "cpu"
    experts = plan["largest_experts"]
    assert experts > 8 and experts % 8 == 0
    request, _ = request_from_args([w for w in most if w not in ("--largest", "--largest-by", "experts")])
    assert not Planner(with_experts(request, experts + 8)).search().fits
