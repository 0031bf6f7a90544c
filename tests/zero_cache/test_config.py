"""Config parsing: every DeepSpeed/AngelPTM key accepted, typos and bad values are one clear error."""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import batches, ds_config, make_model, train_engine
from zero_cache.config import (
    DOC_PATH,
    ZeroCacheConfig,
    ZeroConfigError,
    ZeroOptimizationConfig,
    config_keys,
    parse_config,
)
from zero_cache.config_docs import markdown

ROOT = Path(__file__).resolve().parents[2]

FULL = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "steps_per_print": 5, "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8, "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e7,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_param_persistence_threshold": 1e5, "stage3_gather_16bit_weights_on_model_save": True,
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4, "pipeline_read": False,
                              "pipeline_write": False, "ratio": 1.0},
        "pipeline_optimizer": True, "prefetch_cache_sub_group_rate": 0.1, "max_contigous_params_size": 2e9,
        "max_param_reduce_events": 0, "is_communication_time_profiling": False,
        "save_large_model_multi_slice": True},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True},
}


def test_full_config_parses_into_typed_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(FULL))
    cfg = parse_config(str(path), dp_world_size=4)
    z = cfg.zero_optimization
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 2, 4)
    assert z.stage == 3 and z.allgather_bucket_size == 500_000_000 and isinstance(z.sub_group_size, int)
    assert z.offload_param.device == "cpu" and z.prefetch_cache_sub_group_rate == 0.1
    assert z.max_contigous_params_size == 2_000_000_000 and z.max_param_reduce_events == 0
    assert cfg.optimizer.params.betas == (0.9, 0.95) and cfg.fp16.initial_scale_power == 12
    assert cfg.aio.queue_depth == 8


def test_batch_size_is_derived():
    cfg = parse_config({"train_batch_size": 16, "gradient_accumulation_steps": 2}, dp_world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 2
    cfg = parse_config({"train_micro_batch_size_per_gpu": 3}, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (6, 1)


@pytest.mark.parametrize("config,message", [
    ({"zero_optimization": {"stage3_prefetch_bucket": 10}},
     "unknown key 'zero_optimization.stage3_prefetch_bucket'; "
     "did you mean 'zero_optimization.stage3_prefetch_bucket_size'?"),
    ({"gradient_clip": 1.0}, "unknown key 'gradient_clip'; did you mean 'gradient_clipping'?"),
    ({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}},
     "did you mean 'zero_optimization.offload_optimizer.device'?"),
    ({"zero_optimization": {"stage": "3"}}, "'zero_optimization.stage' must be an integer, got '3'"),
    ({"fp16": {"enabled": 1}}, "'fp16.enabled' must be true or false, got 1"),
    ({"zero_optimization": {"stage": 4}}, "'zero_optimization.stage' must be one of [1, 2, 3], got 4"),
    ({"zero_optimization": {"prefetch_cache_sub_group_rate": 1.5}},
     "'zero_optimization.prefetch_cache_sub_group_rate' must be <= 1.0, got 1.5"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, "'optimizer.params.betas' must be a list of 2 numbers"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size (10) must equal train_micro_batch_size_per_gpu (2) * gradient_accumulation_steps (2) "
     "* data-parallel size (2) = 8"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, "train_batch_size (10) is not divisible"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "cpu"}}},
     "'offload_param.device' = 'nvme' needs 'offload_optimizer.device' = 'nvme' too"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/a"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}},
     "'offload_param.nvme_path' (/a) and 'offload_optimizer.nvme_path' (/b) differ"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs stage 3"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
])
def test_bad_config_is_one_clear_error(config, message):
    with pytest.raises(ZeroConfigError) as e:
        parse_config(config, dp_world_size=2)
    assert message in str(e.value)


def test_a_key_given_twice_or_bytes_that_are_not_utf8_are_one_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage": 1}}')
    with pytest.raises(ZeroConfigError, match="gives 'stage' twice in one object; keep one"):
        parse_config(str(path))
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ZeroConfigError, match="is not valid JSON"):
        parse_config(str(path))


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ZeroConfigError, match="does not exist"):
        parse_config(str(tmp_path / "nope.json"))


def test_nvme_optimizer_offload_is_accepted():
    cfg = parse_config({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}},
                        "aio": {"queue_depth": 4, "intra_op_parallelism": 2}}, dp_world_size=2)
    assert cfg.zero_optimization.offload_optimizer.device == "nvme" and cfg.aio.intra_op_parallelism == 2


# ---- documentation ----------------------------------------------------------------------------------------
def _blocks(cls=ZeroCacheConfig):
    yield cls
    for tp in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(tp):
            yield from _blocks(tp)


def test_every_field_of_every_block_is_documented():
    blocks = list(_blocks())
    assert len(blocks) == 11
    for cls in blocks:
        for f in dataclasses.fields(cls):
            meta = f.metadata
            assert meta.get("doc", "").strip(), f"{cls.__name__}.{f.name} has no doc"
            assert isinstance(meta.get("acts"), bool), f"{cls.__name__}.{f.name} does not say whether it acts"
    assert {k.path.rpartition(".")[2] for k in config_keys()} >= {"allgather_bucket_size", "use_gds", "nvme"}


def test_committed_reference_is_the_generators_output():
    committed = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    assert committed == markdown(), f"{DOC_PATH} is stale: run python -m zero_cache.config_docs > {DOC_PATH}"
    for k in config_keys():
        assert f"| `{k.path}` |" in committed


@pytest.mark.multiprocess
def test_generator_command_prints_the_reference():
    proc = subprocess.run([sys.executable, "-m", "zero_cache.config_docs"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert proc.stdout == markdown()


# ---- keys without effect ----------------------------------------------------------------------------------
INERT = [k.path for k in config_keys() if not k.acts]


def _nested(paths_values: dict) -> dict:
    out: dict = {}
    for path, value in paths_values.items():
        *blocks, name = path.split(".")
        node = out
        for b in blocks:
            node = node.setdefault(b, {})
        node[name] = value
    return out


def _inert_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "zero_cache.config" and "have no effect here" in r.getMessage()]


def test_inert_keys_are_the_deepspeed_keys_without_a_mechanism_here():
    assert INERT == [
        "wall_clock_breakdown", "fp16.auto_cast", "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_optimizer.ratio",
        "zero_optimization.mics_hierarchical_params_gather", "zero_optimization.zero_quantized_nontrainable_weights",
        "aio.single_submit", "aio.overlap_events", "aio.use_gds"]


def test_set_inert_keys_warn_once_naming_them(caplog):
    defaults = {k.path: k.default for k in config_keys() if not k.acts}
    with caplog.at_level(logging.WARNING, logger="zero_cache.config"):
        parse_config(_nested(defaults))  # set to their defaults: still set, still named
    (message,) = _inert_warnings(caplog)
    assert message == ("zero_cache config: keys accepted for DeepSpeed compatibility that have no effect here: "
                       + ", ".join(INERT) + f" (see {DOC_PATH})")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero_cache.config"):
        parse_config(FULL, dp_world_size=4)
    (message,) = _inert_warnings(caplog)
    named = message.split("no effect here: ")[1].split(" (see")[0].split(", ")
    assert named == ["wall_clock_breakdown", "zero_optimization.contiguous_gradients",
                     "zero_optimization.reduce_bucket_size",
                     "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                     "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
                     "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.buffer_count",
                     "zero_optimization.offload_optimizer.pipeline_read",
                     "zero_optimization.offload_optimizer.pipeline_write", "zero_optimization.offload_optimizer.ratio",
                     "aio.single_submit", "aio.overlap_events"]


def test_defaults_and_built_configs_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="zero_cache.config"):
        parse_config({})
        cfg = parse_config({"zero_optimization": {"stage": 2, "overlap_comm": True, "sub_group_size": 10}})
        parse_config(ZeroCacheConfig())
        parse_config(cfg)
    assert _inert_warnings(caplog) == []


# ---- overlap_comm -----------------------------------------------------------------------------------------
def test_overlap_comm_false_waits_for_every_reduction():
    assert parse_config({}).zero_optimization.max_param_reduce_events == 1
    z = parse_config({"zero_optimization": {"overlap_comm": False}}).zero_optimization
    assert z.max_param_reduce_events == 0
    z = parse_config({"zero_optimization": {"overlap_comm": False, "max_param_reduce_events": 0}}).zero_optimization
    assert z.max_param_reduce_events == 0
    z = parse_config({"zero_optimization": {"overlap_comm": True, "max_param_reduce_events": 3}}).zero_optimization
    assert z.max_param_reduce_events == 3
    built = ZeroCacheConfig(zero_optimization=ZeroOptimizationConfig(overlap_comm=False))
    assert parse_config(built).zero_optimization.max_param_reduce_events == 0
    assert built.zero_optimization.max_param_reduce_events == 1  # the caller's object is not changed
    with pytest.raises(ZeroConfigError, match=r"'zero_optimization.overlap_comm' is false .* but "
                                              r"'zero_optimization.max_param_reduce_events' is 2"):
        parse_config({"zero_optimization": {"overlap_comm": False, "max_param_reduce_events": 2}})


def _reductions_in_flight(rank: int, world: int, overlap: bool):
    """Two ranks: a one-rank group reduces nothing (its gradient shard is the buffer), so no reduction to count."""
    config = ds_config(2, world, overlap_comm=overlap)
    del config["zero_optimization"]["max_param_reduce_events"]
    engine = zero_cache.initialize(make_model(), config)
    in_flight = []
    reduce = engine.reducer._reduce

    def spy(c):
        reduce(c)
        in_flight.append(len(engine.reducer.pending))
    engine.reducer._reduce = spy
    losses = train_engine(engine, batches(2), rank=rank, dp=world)
    weights = engine.gather_state_dict()
    engine.close()
    return losses, weights, in_flight


@pytest.mark.multiprocess
def test_engine_without_overlap_comm_has_no_reduction_in_flight():
    losses, weights, in_flight = run_distributed(_reductions_in_flight, 2, False)[0]
    assert in_flight and max(in_flight) == 0
    ref_losses, ref_weights, ref_in_flight = run_distributed(_reductions_in_flight, 2, True)[0]
    assert max(ref_in_flight) == 1
    assert losses == ref_losses and all(torch.equal(weights[n], ref_weights[n]) for n in weights)
