"""pretrain_gpt.py --deepspeed: ZeRO stages inside the 3D-parallel trainer match the single-process reference."""
import json

import pytest
import torch

from tests.training.parallel_harness import MESHES, check_matches_reference, ds_config_flags


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_dp2_matches_reference(tmp_path, stage):
    check_matches_reference([], ds_config_flags(tmp_path, stage), 2)


@pytest.mark.multiprocess
def test_zero3_offload_tp2pp2dp2_matches_reference(tmp_path):
    """ZeRO-3 under pipeline parallelism with the 1F1B schedule (DeepSpeed refuses this combination)."""
    flags, world = MESHES["tp2pp2dp2"]
    check_matches_reference([], flags + ds_config_flags(tmp_path, 3, offload=True), world)


@pytest.mark.multiprocess
def test_zero3_states_on_ssd_tp2pp2dp2_matches_reference(tmp_path):
    """Optimizer states and parameter shards in SSD page files, pipelined step, under TP2 x PP2 x DP2."""
    flags, world = MESHES["tp2pp2dp2"]
    check_matches_reference([], flags + ds_config_flags(tmp_path, 3, nvme=True), world)
    swap = tmp_path / "swap" / "zero_cache_swap"
    assert swap.is_dir() and not list(swap.iterdir())  # the page files were there, and are removed at exit


@pytest.mark.parametrize("name", ["ds_config_zero3.json", "ds_config_zero3_offload.json"])
def test_shipped_example_configs_parse(name):
    from pathlib import Path

    import zero_cache

    cfg = zero_cache.parse_config(str(Path(__file__).resolve().parents[2] / "examples" / name), 2)
    assert cfg.zero_optimization.stage == 3


@pytest.mark.multiprocess
def test_config_disagreeing_with_flags_is_one_clear_error(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tests.training.parallel_harness import TINY_GPT

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}))
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY_GPT, "--deepspeed", "--deepspeed_config",
                           str(path)], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "'train_micro_batch_size_per_gpu': 4 disagrees with --micro-batch-size (2)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_misspelled_key_names_the_nearest(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tests.training.parallel_harness import TINY_GPT

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_grup_size": 10}}))
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *TINY_GPT, "--deepspeed", "--deepspeed_config",
                           str(path)], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "sub_grup_size" in proc.stderr and "sub_group_size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_zero3_mixed_precision_trains(tmp_path, precision):
    from tests.training.parallel_harness import TINY_GPT, train

    argv = TINY_GPT + ds_config_flags(tmp_path, 3) + [precision, "--initial-loss-scale", "4096"]
    losses, params, _ = train(argv, 2)
    assert losses[10] < losses[1] - 0.1
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in params.values())
