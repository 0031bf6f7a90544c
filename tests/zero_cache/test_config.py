"""Config parsing: every DeepSpeed/AngelPTM key accepted, typos and bad values are one clear error."""
from __future__ import annotations

import json

import pytest

from zero_cache.config import ZeroConfigError, parse_config

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


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ZeroConfigError, match="does not exist"):
        parse_config(str(tmp_path / "nope.json"))


def test_nvme_optimizer_offload_is_accepted():
    cfg = parse_config({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}},
                        "aio": {"queue_depth": 4, "intra_op_parallelism": 2}}, dp_world_size=2)
    assert cfg.zero_optimization.offload_optimizer.device == "nvme" and cfg.aio.intra_op_parallelism == 2
