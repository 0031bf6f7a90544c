"""ZeRO-3 distributed checkpoints: exact resume in fresh processes, and consolidation to one fp32 state dict."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import zero_cache
from tests.dist_utils import run_distributed
from tests.zero_cache.common import (
    assert_close_weights,
    batches,
    ds_config,
    make_model,
    reference_run,
    to_numpy,
    train_engine,
)
from zero_cache.checkpoint.consolidate import load_consolidated

pytestmark = pytest.mark.multiprocess

DP = 2


def _engine(world_size):
    model = make_model(seed=123)  # a different init: load_checkpoint must overwrite everything
    engine = zero_cache.initialize(model=model, config=ds_config(3, world_size, offload=True))
    engine.register_external_parameter(model.head, model.embed.weight)
    return model, engine


def _train_and_save(rank, world_size, ckpt_dir):
    model = make_model()
    engine = zero_cache.initialize(model=model, config=ds_config(3, world_size, offload=True))
    engine.register_external_parameter(model.head, model.embed.weight)
    data = batches()
    first = train_engine(engine, data, rank, world_size, steps=range(5))
    engine.save_checkpoint(ckpt_dir, client_state={"iteration": 5})
    at_save = to_numpy(engine.gather_state_dict())
    rest = train_engine(engine, data, rank, world_size, steps=range(5, 10))
    return first, rest, at_save


def _resume(rank, world_size, ckpt_dir):
    _, engine = _engine(world_size)
    path, client = engine.load_checkpoint(ckpt_dir)
    assert client == {"iteration": 5} and engine.global_steps == 5
    rest = train_engine(engine, batches(), rank, world_size, steps=range(5, 10))
    return rest, os.path.basename(path)


def test_resume_is_exact_and_consolidation_round_trips(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, DP, ckpt, timeout=180)
    files = sorted(os.listdir(os.path.join(ckpt, "global_step5")))
    # DCP's metadata and one file per rank, then the checksums that mark the directory complete.
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(DP)] + ["checksums.json"]
    assert open(os.path.join(ckpt, "latest")).read() == "global_step5"

    resumed = run_distributed(_resume, DP, ckpt, timeout=180)
    for r in range(DP):
        assert resumed[r][1] == "global_step5"
        assert resumed[r][0] == saved[r][1], f"rank {r}: resumed steps 6-10 differ"

    out = str(tmp_path / "consolidated")
    proc = subprocess.run([sys.executable, "-m", "zero_cache.checkpoint.consolidate", ckpt, out],
                          capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    merged = load_consolidated(out)
    _, ref_weights = reference_run(steps=5)
    assert_close_weights(merged, ref_weights[-1])
    for k, v in saved[0][2].items():  # bit-identical to the engine's own gathered fp32 masters
        assert torch.equal(merged[k], torch.as_tensor(v)), k
    assert all(v.dtype == torch.float32 for v in merged.values())
