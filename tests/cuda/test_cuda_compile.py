"""``--compile`` on a GPU (Triton kernels): pretrain_gpt.py with ZeRO-3 and pinned host states, compiled against
eager, fp32 without TF32 (skipped without a GPU; benchmarks/gpu_check.sh runs it on one)."""
from __future__ import annotations

import json

import pytest

from tests.cuda.common import gpu_only
from tests.cuda.test_cuda_paths import RANK_TIMEOUT, _train_on_gpu
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT

pytestmark = gpu_only()


@pytest.mark.multiprocess
def test_compiled_layers_on_gpu_train_as_eager(tmp_path):
    argv = list(TINY_GPT)
    argv[argv.index("--distributed-backend") + 1] = "nccl"
    ds = tmp_path / "ds_zero3_offload.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 64, "sub_group_size": 5000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}}))
    argv += ["--deepspeed", "--deepspeed_config", str(ds)]
    eager, compiled = (run_distributed(_train_on_gpu, 1, a, backend="nccl", timeout=3 * RANK_TIMEOUT)[0]
                       for a in (argv, argv + ["--compile"]))
    assert compiled["devices"] == ["cuda"] and sorted(compiled["losses"]) == list(range(1, 11))
    for it, loss in eager["losses"].items():
        assert compiled["losses"][it] == pytest.approx(loss, rel=1e-4), f"iteration {it}"
