"""pretrain_gpt.py --deepspeed under TP2 x PP2 x DP2 (8 ranks) with the emulated accelerator: parameter and
optimizer shards in host memory reached by emulated copies with random delays, half of the optimizer
sub-groups on the device (the heterogeneous step) and the speculative host update; losses and weights equal
the single-process Megatron run within 1e-5."""
import json

import pytest

from tests.training.parallel_harness import MESHES, check_matches_reference

pytestmark = pytest.mark.multiprocess


def test_tp2pp2dp2_with_emulated_accelerator_matches_single_process(tmp_path):
    flags, world = MESHES["tp2pp2dp2"]
    zero = {"stage": 3, "allgather_bucket_size": 3000, "stage3_param_persistence_threshold": 64,
            "sub_group_size": 5000, "prefetch_cache_sub_group_rate": 0.5, "speculative_update": True,
            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
            "emulated_accelerator": {"enabled": True, "h2d_gbps": 0.5, "d2h_gbps": 0.5, "random_delay_ms": 1.0}}
    path = tmp_path / "ds_emulated.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    check_matches_reference([], flags + ["--deepspeed", "--deepspeed_config", str(path)], world)
