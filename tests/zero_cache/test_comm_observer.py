"""zero_cache.comm.observe_collectives, which the CUDA tests use to see what an engine sends over NCCL: on two
gloo ranks it reports every collective of a training step, the data-parallel group's (as many and as large as
the communication profiler measures) and group_all_reduce's on other groups, with gloo's point-to-point
collectives and with torch's own; the flat collectives are looked up when called, so a torch without
``all_gather_single`` / ``reduce_scatter_single`` (the GPU image's 2.11) uses ``*_into_tensor`` / ``*_tensor``
and trains the same; nothing is reported outside the block or without a peer."""
from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch.distributed as dist

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import batches, ds_config, make_model, train_engine
from zero_cache.comm import COLLECTIVES, observe_collectives

DP, STEPS = 2, 2


def _observed_steps(rank: int, world_size: int, p2p: bool, old_torch_names: bool) -> dict:
    dp = dist.new_group(list(range(world_size)))  # a group of its own: told apart from WORLD below
    cfg = ds_config(3, world_size, is_communication_time_profiling=True, gloo_p2p_collectives=p2p)
    old_names = mock.patch.multiple(dist, create=True, all_gather_single=None, reduce_scatter_single=None)
    seen, outer, steps, losses = [], [], [], []

    def record(kind, tensor, group, tag):
        seen.append((kind, "dp" if group is dp else "world", tensor.numel() * tensor.element_size()))

    with old_names if old_torch_names else contextlib.nullcontext(), observe_collectives(record), \
            observe_collectives(lambda *a: outer.append(a[0])):
        model = make_model()  # the start-up broadcast counts in the first step, as the profiler counts it
        engine = zero_cache.initialize(model=model, config=cfg, dp_group=dp, model_parallel_group=dist.group.WORLD,
                                       tied_param_groups=[(model.embed.weight, dist.group.WORLD)])
        engine.register_external_parameter(model.head, model.embed.weight)
        start = 0
        for s in range(STEPS):
            losses += train_engine(engine, batches(STEPS), rank, world_size, steps=[s])
            mine, start = seen[start:], len(seen)
            measured = engine.last_comm_stats.measured
            steps.append({"seen": Counter((k, g) for k, g, _ in mine),
                          "dp_bytes": {k: sum(b for kk, g, b in mine if kk == k and g == "dp") for k in COLLECTIVES},
                          "profiled": {k: (measured[k].count, measured[k].nbytes) for k in COLLECTIVES}})
    train_engine(engine, batches(STEPS + 1), rank, world_size, steps=[STEPS])  # outside the block
    engine.close()
    return {"steps": steps, "losses": losses, "outer": len(outer), "seen": start, "after": len(seen)}


@pytest.mark.multiprocess
def test_observer_sees_every_collective_of_a_step():
    runs = {(p2p, old): run_distributed(_observed_steps, DP, p2p, old, timeout=120)
            for p2p, old in ((True, False), (False, False), (False, True))}
    for (p2p, old), results in runs.items():
        for r in results:
            assert r["outer"] == r["seen"] > 0 and r["after"] == r["seen"]  # both observers, only in the block
            for step, s in enumerate(r["steps"], 1):
                for kind in COLLECTIVES:
                    # The data-parallel group's collectives: exactly those the profiler measures.
                    assert (s["seen"][(kind, "dp")], s["dp_bytes"][kind]) == s["profiled"][kind], (p2p, old, step)
                # group_all_reduce over WORLD: the model-parallel norm and the tied embedding's gradient.
                assert s["seen"][("all_reduce", "world")] == 2, (p2p, old, step)
                assert s["seen"][("reduce_scatter", "dp")] > 0 and s["seen"][("all_gather", "dp")] > 0
    # Point-to-point or torch's collectives, new names or old: the same training.
    for run in ((True, False), (False, True)):
        assert runs[run][0]["losses"] == pytest.approx(runs[(False, False)][0]["losses"], rel=1e-6), run


def test_nothing_is_reported_without_a_peer():
    seen = []
    model = make_model()
    engine = zero_cache.initialize(model=model, config=ds_config(3, 1))
    engine.register_external_parameter(model.head, model.embed.weight)
    with observe_collectives(lambda *a: seen.append(a)):
        train_engine(engine, batches(1), 0, 1)
    engine.close()
    assert seen == []
