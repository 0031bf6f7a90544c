"""save_checkpoint / load_checkpoint: Megatron layout, exact round trip, atomicity and clear errors."""
import argparse
import os

import pytest
import torch

from megatron.model.gpt_model import GPTModel
from megatron.training.arguments.checkpoint import add_checkpoint_args, checkpoint_config_from_args
from megatron.training.checkpoint import legacy as ckpt
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.legacy import load_checkpoint, save_checkpoint
from tests.checkpoint.common import (
    CONFIGS,
    MESHES,
    StepCounter,
    assert_same,
    build_trained,
    load_worker,
    megatron_args,
    unpack,
)
from tests.dist_utils import run_distributed
from zero_cache.checkpoint import CheckpointError

CFG = CONFIGS["gpt2"]


def _cfg(save=None, load=None, **kw) -> CheckpointConfig:
    return CheckpointConfig(save=None if save is None else str(save), load=None if load is None else str(load),
                            save_interval=None, **kw)


LAYOUTS = {"tp2pp2": ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"],
           "tp2dp2": ["mp_rank_00", "mp_rank_01"]}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_layout_and_weights_only(saved, mesh):
    root, _ = saved
    tp, pp = MESHES[mesh]
    for name in CONFIGS:
        base = os.path.join(root, mesh, name)
        assert sorted(os.listdir(base)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
        with open(os.path.join(base, "latest_checkpointed_iteration.txt")) as f:
            assert f.read().strip() == "3"
        it_dir = os.path.join(base, "iter_0000003")
        assert sorted(os.listdir(it_dir)) == LAYOUTS[mesh]
        for sub in os.listdir(it_dir):
            # the file and its checksum, no temp files left
            assert sorted(os.listdir(os.path.join(it_dir, sub))) == ["model_optim_rng.pt", "model_optim_rng.pt.crc32"]
            state = torch.load(os.path.join(it_dir, sub, "model_optim_rng.pt"), map_location="cpu", weights_only=True)
            assert set(state) == {"args", "checkpoint_version", "iteration", "consumed_samples", "model",
                                  "optimizer", "opt_param_scheduler", "rng_state"}
            assert (state["checkpoint_version"], state["iteration"], state["consumed_samples"]) == (3.0, 3, 48)
            dp = 4 // (tp * pp)
            assert (state["args"]["tensor_model_parallel_size"], state["args"]["data_parallel_size"]) == (tp, dp)
            assert len(state["rng_state"]) == dp  # one entry per data-parallel rank
            if dp == 2:
                assert not torch.equal(state["rng_state"][0]["torch_rng_state"],
                                       state["rng_state"][1]["torch_rng_state"])
            assert set(state["rng_state"][0]) == {"random_rng_state", "np_rng_state", "torch_rng_state",
                                                  "rng_tracker_states"}


@pytest.mark.multiprocess
def test_round_trip_in_fresh_processes_is_exact(saved):
    root, before_all = saved
    loaded = [unpack(r) for r in run_distributed(load_worker, 4, root, MESHES)]
    for rank, (before, after) in enumerate(zip(before_all, loaded)):
        for key in before:
            assert (after[key]["iteration"], after[key]["consumed"]) == (3, 48)
            for part in ("model", "optimizer", "scheduler", "draws"):
                assert_same(before[key][part], after[key][part], f"rank {rank} {key} {part}")
    # Every rank, data-parallel peers included, had different RNG states and got its own back.
    assert len({tuple(b["tp2dp2", "gpt2"]["draws"][2].tolist()) for b in before_all}) == 4


def test_crash_before_tracker_update_keeps_previous_checkpoint(single_rank, tmp_path, monkeypatch):
    model, opt, sched = build_trained(CFG)
    args = megatron_args(CFG, 1, 1, 1)
    save_checkpoint(_cfg(save=tmp_path), 1, model, opt, sched, consumed_samples=8, args=args)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(root, iteration):
        raise KeyboardInterrupt("killed before the tracker was written")
    monkeypatch.setattr(ckpt, "write_tracker", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_cfg(save=tmp_path), 2, model, opt, sched, consumed_samples=16, args=args)
    monkeypatch.undo()
    assert os.path.isfile(tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]

    fresh = GPTModel(CFG)
    assert load_checkpoint(_cfg(load=tmp_path), fresh, None, None) == (1, 8)
    assert_same(first, fresh.state_dict())


@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_mismatch_names_the_sizes_to_use(single_rank, saved, mesh):
    root, _ = saved
    tp, pp = MESHES[mesh]
    with pytest.raises(CheckpointError, match=f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"):
        load_checkpoint(_cfg(load=os.path.join(root, mesh, "gpt2")), GPTModel(CFG), None, None)


def test_missing_and_corrupt_checkpoints(single_rank, tmp_path, capsys):
    model = GPTModel(CFG)
    assert load_checkpoint(_cfg(load=tmp_path / "nothing"), model, None, None) == (0, 0)
    assert "starting from scratch" in capsys.readouterr().out

    trained, opt, sched = build_trained(CFG)
    save_checkpoint(_cfg(save=tmp_path), 4, trained, opt, sched, consumed_samples=4, args=megatron_args(CFG, 1, 1, 1))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(CheckpointError, match="iter_0000009 does not exist"):
        load_checkpoint(_cfg(load=tmp_path), model, None, None)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4\n")
    path = tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"{path} is truncated or was overwritten"):  # the recorded checksum
        load_checkpoint(_cfg(load=tmp_path), model, None, None)
    os.remove(f"{path}.crc32")  # as written by a version that recorded none: the archive check still catches it
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {path}"):
        load_checkpoint(_cfg(load=tmp_path), model, None, None)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("four\n")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        load_checkpoint(_cfg(load=tmp_path), model, None, None)


def test_no_save_optim_finetune_and_no_load_rng(single_rank, tmp_path):
    trained, opt, sched = build_trained(CFG)
    save_checkpoint(_cfg(save=tmp_path, no_save_optim=True), 6, trained, opt, sched, consumed_samples=24,
                    args=megatron_args(CFG, 1, 1, 1))
    state = torch.load(tmp_path / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert "optimizer" not in state and "opt_param_scheduler" not in state

    model = GPTModel(CFG)
    fresh_opt, fresh_sched = torch.optim.AdamW(model.parameters(), lr=0.5), StepCounter()
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        load_checkpoint(_cfg(load=tmp_path), model, fresh_opt, fresh_sched)
    assert load_checkpoint(_cfg(load=tmp_path, no_load_optim=True), model, fresh_opt, fresh_sched) == (6, 24)
    assert load_checkpoint(_cfg(load=tmp_path, finetune=True), model, fresh_opt, fresh_sched) == (0, 0)
    assert_same(trained.state_dict(), model.state_dict())
    assert fresh_opt.state_dict()["state"] == {} and fresh_opt.param_groups[0]["lr"] == 0.5
    assert fresh_sched.num_steps == 0

    # RNG states of two data-parallel ranks cannot be restored on one: clear error, --no-load-rng skips them.
    state["rng_state"] = state["rng_state"] * 2
    ckpt.write_atomic(state, str(tmp_path / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt"))
    with pytest.raises(CheckpointError, match="--no-load-rng"):
        load_checkpoint(_cfg(load=tmp_path, no_load_optim=True), model, None, None)
    before = torch.get_rng_state()
    assert load_checkpoint(_cfg(load=tmp_path, no_load_optim=True, no_load_rng=True), model, None, None) == (6, 24)
    assert torch.equal(before, torch.get_rng_state())


def test_model_that_does_not_fit_is_a_clear_error(single_rank, tmp_path):
    trained, opt, sched = build_trained(CFG)
    save_checkpoint(_cfg(save=tmp_path), 1, trained, opt, sched, consumed_samples=0, args=megatron_args(CFG, 1, 1, 1))
    other = GPTModel(CONFIGS["llama"])
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_checkpoint(_cfg(load=tmp_path), other, None, None)


def test_model_chunks_round_trip_and_refuse_another_chunk_count(single_rank, tmp_path):
    """The interleaved schedule's chunks are saved as Megatron's model0, model1 and load back exactly; a run with
    another number of chunks per stage gets one error naming the flag."""
    cfg = CONFIGS["llama"]
    trained, opt, sched = build_trained(cfg, virtual_stages=2)
    save_checkpoint(_cfg(save=tmp_path), 1, list(trained.chunks), opt, sched, consumed_samples=0,
                    args=megatron_args(cfg, 1, 1, 1))
    file = ckpt.load_file(ckpt.checkpoint_file(str(tmp_path), 1, 0, 0, 1))
    assert ckpt.model_keys(file) == ["model0", "model1"] and "model" not in file
    fresh, _, _ = build_trained(cfg, virtual_stages=2)
    load_checkpoint(_cfg(load=tmp_path, no_load_optim=True), list(fresh.chunks), None, None)
    assert_same(fresh.state_dict(), trained.state_dict())
    with pytest.raises(CheckpointError, match="holds 2 model chunk.* this run has 1: relaunch with "
                                              "--virtual-pipeline-model-parallel-size 2"):
        load_checkpoint(_cfg(load=tmp_path), GPTModel(cfg), None, None)


def test_non_plain_state_is_rejected_at_save_time(single_rank, tmp_path):
    model, opt, sched = build_trained(CFG)
    with pytest.raises(CheckpointError, match=r"args\['tokenizer'\] is a object"):
        save_checkpoint(_cfg(save=tmp_path), 1, model, opt, sched, consumed_samples=0, args={"tokenizer": object()})
    assert not os.listdir(tmp_path)


def test_checkpoint_args_parse():
    parser = add_checkpoint_args(argparse.ArgumentParser())
    a = parser.parse_args(["--save", "s", "--load", "l", "--save-interval", "5", "--no-save-optim", "--finetune"])
    assert checkpoint_config_from_args(a) == CheckpointConfig(save="s", load="l", save_interval=5,
                                                              no_save_optim=True, finetune=True)
    with pytest.raises(ValueError, match="--save-interval must be >= 1"):
        checkpoint_config_from_args(parser.parse_args(["--save-interval", "0"]))
