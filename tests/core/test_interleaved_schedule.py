"""The interleaved 1F1B schedule's order on simulated pipelines, its model-chunk container and its flags.

The simulation runs every rank's rounds (``InterleavedSchedule.rounds``) against its neighbours with blocking
point-to-point semantics: an exchange completes only when each of its sends meets the matching receive posted by
the neighbour's exchange of the moment (and the other way round), channels being in-order per direction. A
round's compute runs when it starts. It checks that no configuration deadlocks, that every tensor received is
the one its consumer needs (the right virtual stage and micro-batch), and the (chunk, micro-batch, fwd/bwd) order.
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.pipeline_parallel.interleaved import InterleavedSchedule
from megatron.core.pipeline_parallel.model_chunks import ModelChunks, chunk_of, named_chunks
from megatron.core.pipeline_parallel.one_f_one_b import OneFOneBSchedule
from megatron.core.pipeline_parallel.schedules import _ReplayedMicroBatches
from megatron.core.transformer_config import TransformerConfig
from megatron.model.gpt_model import GPTModel
from megatron.training.arguments import parse_args
from megatron.training.checkpoint.layout import model_layout
from megatron.training.config import ConfigError
from tests.training.parallel_harness import TINY_GPT

Event = tuple[str, int, int]  # ("F" | "B" | "W", chunk, micro-batch)


def simulate(p: int, v: int, m: int, forward_only: bool = False, schedule=None) -> list[list[Event]]:
    """Run the p ranks' schedules together (``schedule(p, rank, v, m)``, default the interleaved one); returns
    each rank's compute events in order."""
    plans = [(schedule or InterleavedSchedule)(p, r, v, m) for r in range(p)]
    rounds = [plan.rounds(forward_only) for plan in plans]
    at = [0] * p  # each rank's current round
    posted: list[list[dict] | None] = [None] * p  # the operations of each rank's current exchange
    counts: dict[tuple, int] = {}  # (kind, src, dst, direction) -> operations posted so far
    inbox = [[{"F": [], "B": []} for _ in range(v)] for _ in range(p)]  # received tensors by chunk
    events: list[list[Event]] = [[] for _ in range(p)]

    def post(kind: str, src: int, dst: int, direction: str, what) -> dict:
        key = (kind, src, dst, direction)
        counts[key] = counts.get(key, 0) + 1
        return {"kind": kind, "channel": (src, dst, direction), "index": counts[key], "what": what, "done": False}

    def start(r: int) -> None:
        plan, rd, ops = plans[r], rounds[r][at[r]], []
        if rd.forward is not None:
            c, mb = plan.chunk(rd.forward), plan.microbatch(rd.forward)
            if plan.input_received(rd.forward):  # from the previous stage's same chunk, or over the ring
                assert inbox[r][c]["F"].pop(0) == ((c, mb, r - 1) if r > 0 else (c - 1, mb, p - 1))
            else:
                assert r == 0 and c == 0
            events[r].append(("F", c, mb))
            if rd.send_forward:
                ops.append(post("send", r, (r + 1) % p, "F", (c, mb, r)))
            else:
                assert r == p - 1 and c == v - 1  # only the loss stays
        if rd.backward is not None:
            c, mb = plan.chunk(rd.backward, forward=False), plan.microbatch(rd.backward)
            assert ("F", c, mb) in events[r]  # every backward after its forward
            if plan.grad_received(rd.backward):
                assert inbox[r][c]["B"].pop(0) == ((c, mb, r + 1) if r < p - 1 else (c + 1, mb, 0))
            else:
                assert r == p - 1 and c == v - 1
            events[r].append(("B", c, mb))
            if rd.send_backward:
                ops.append(post("send", r, (r - 1) % p, "B", (c, mb, r)))
            else:
                assert r == 0 and c == 0
        for k in rd.weights:  # a split backward's weight pass, after its input-gradient pass
            c, mb = plan.chunk(k, forward=False), plan.microbatch(k)
            assert ("B", c, mb) in events[r] and ("W", c, mb) not in events[r]
            events[r].append(("W", c, mb))
        if rd.recv_forward is not None:
            ops.append(post("recv", (r - 1) % p, r, "F", rd.recv_forward))
        if rd.recv_backward is not None:
            ops.append(post("recv", (r + 1) % p, r, "B", rd.recv_backward))
        posted[r] = ops

    for r in range(p):
        start(r)
    while any(at[r] < len(rounds[r]) for r in range(p)):
        progress = False
        for r in range(p):
            for send in [op for op in posted[r] or [] if op["kind"] == "send" and not op["done"]]:
                dst = send["channel"][1]
                for recv in posted[dst] or []:
                    if (recv["kind"], recv["channel"], recv["index"]) == ("recv", send["channel"], send["index"]):
                        send["done"] = recv["done"] = progress = True
                        inbox[dst][recv["what"]][send["channel"][2]].append(send["what"])
        for r in range(p):
            if posted[r] is not None and all(op["done"] for op in posted[r]):
                at[r] += 1
                posted[r] = None
                progress = True
                if at[r] < len(rounds[r]):
                    start(r)
        assert progress, f"p={p} v={v} m={m}: deadlock at rounds {at}"
    assert all(not box[d] for boxes in inbox for box in boxes for d in "FB")  # everything sent was used
    return events


@pytest.mark.parametrize("p,v", [(2, 2), (2, 4), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("forward_only", [False, True])
def test_simulated_pipeline_order(p, v, groups, forward_only):
    m = groups * p
    events = simulate(p, v, m, forward_only)
    for r, ev in enumerate(events):
        forwards, backwards = [e for e in ev if e[0] == "F"], [e for e in ev if e[0] == "B"]
        for c in range(v):  # each chunk sees the micro-batches in order, once
            assert [mb for _, k, mb in forwards if k == c] == list(range(m))
            assert [mb for _, k, mb in backwards if k == c] == ([] if forward_only else list(range(m)))
        if not forward_only:
            plan = InterleavedSchedule(p, r, v, m)
            # Warm-up forwards come first (all of them when m == p), the last backward is chunk 0's last.
            assert ev[:plan.warmup()] == forwards[:plan.warmup()] and ev[plan.warmup()][0] == ("F" if m > p else "B")
            assert plan.warmup() == (v * m if m == p else (p - r - 1) * 2 + (v - 1) * p)
            assert backwards[-1] == ("B", 0, m - 1)
            last = [k for k in range(v * m) if plan.is_last_backward_of_chunk(k)]
            assert [plan.chunk(k, forward=False) for k in last] == list(reversed(range(v)))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("forward_only", [False, True])
def test_one_f_one_b_rounds_run_pipedream_flush_order(p, m, forward_only):
    """The 1F1B rounds on simulated pipelines: no deadlock, every tensor where it is needed, and each rank's
    order is PipeDream-flush's: min(p - r - 1, m) forwards, then one forward and one backward, then the rest."""
    events = simulate(p, 1, m, forward_only, schedule=lambda p, r, v, m: OneFOneBSchedule(p, r, m))
    for r, ev in enumerate(events):
        w = m if forward_only else min(p - r - 1, m)
        expected = [("F", 0, k) for k in range(w)]
        for k in range(m - w):
            expected += [("F", 0, w + k)] + ([] if forward_only else [("B", 0, k)])
        expected += [] if forward_only else [("B", 0, k) for k in range(m - w, m)]
        assert ev == expected, (r, ev)


def test_order_of_a_small_pipeline():
    """PP2 x v2, 4 micro-batches: groups of 2 micro-batches go through chunk 0, then chunk 1."""
    ev = simulate(2, 2, 4)
    assert ev[0] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
                     ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1), ("F", 1, 2), ("B", 0, 0), ("F", 1, 3),
                     ("B", 0, 1), ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3)]
    assert ev[1][:3] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0)] and ev[1][3] == ("B", 1, 0)


def test_schedule_needs_whole_groups_of_micro_batches():
    with pytest.raises(ValueError, match="not a multiple of 2"):
        InterleavedSchedule(2, 0, 2, 3)
    with pytest.raises(ValueError, match=">= 2 stages"):
        InterleavedSchedule(1, 0, 2, 4)


def test_config_errors():
    vpp = ["--num-layers-per-virtual-pipeline-stage", "1"]
    with pytest.raises(ConfigError, match="needs --pipeline-model-parallel-size > 1"):
        parse_args(TINY_GPT + vpp, world_size=1)
    with pytest.raises(ConfigError, match="must divide the layers per pipeline stage"):
        parse_args(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                               "3"], world_size=2)
    with pytest.raises(ConfigError, match="disagree"):
        parse_args(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"]
                   + vpp, world_size=2)
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size 2"):
        parse_args(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "6"] + vpp, world_size=2)
    cfg = parse_args(TINY_GPT + ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
                                 "2"], world_size=2)
    assert cfg.parallel.virtual_stages == 2


def test_each_chunk_replays_the_step_micro_batches():
    source = iter(range(100))
    replay = _ReplayedMicroBatches(source, 3)
    readers = [replay.reader() for _ in range(3)]
    got = [[next(readers[0]), next(readers[0])], [next(readers[1])], []]
    got[2] += [next(readers[2]), next(readers[2])]
    got[1].append(next(readers[1]))
    assert got == [[0, 1], [0, 1], [0, 1]]
    assert next(source) == 2  # each micro-batch was read once
    assert replay.pending == {}  # and dropped once every chunk had it
    assert _ReplayedMicroBatches(None, 2).reader() is None


def test_model_chunks_run_the_model_in_pieces(single_rank):
    """On one stage, chunk 0 then chunk 1 (layers 0-1, 2-3) compute what the whole model does; names and the
    checkpoint layout map the chunks' parameters to the whole model's."""
    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, padded_vocab_size=64,
                            hidden_dropout=0.0, attention_dropout=0.0)
    whole = GPTModel(cfg)
    chunks = ModelChunks([GPTModel(cfg, virtual_stage=k, virtual_stages=2) for k in range(2)])
    assert chunks.pre_process and chunks.post_process and chunks.config is cfg
    assert [c.layer_offset for c in chunks.chunks] == [0, 2]
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, -1)
    chunks.select(0)
    hidden = chunks(tokens, positions)
    chunks.select(1)
    chunks.set_input_tensor(hidden)
    torch.testing.assert_close(chunks(tokens, positions, labels=tokens), whole(tokens, positions, labels=tokens),
                               rtol=0, atol=0)
    with pytest.raises(IndexError):
        chunks.select(2)
    assert chunks.shared_embedding_weight() is None and chunks.moe_routers() == [] and chunks.moe_stats is None

    assert [prefix for prefix, _ in named_chunks(chunks)] == ["chunks.0.", "chunks.1."]
    assert named_chunks(whole) == [("", whole)]
    assert chunk_of(chunks, "chunks.1.decoder.layers.0.mlp.linear_fc1.weight") == (
        chunks.chunks[1], "decoder.layers.0.mlp.linear_fc1.weight")
    layout = model_layout(chunks)
    assert {place.name for place in layout.values()} == {name for name, _ in whole.named_parameters()}
    assert layout["chunks.1.decoder.layers.1.mlp.linear_fc1.weight"].name == "decoder.layers.3.mlp.linear_fc1.weight"
