"""Save at iteration 5, resume in fresh processes: iterations 6-10 equal the uninterrupted run exactly.

Megatron's per-rank layout (``--ckpt-format torch``) also holds context-parallel runs (their ranks are data-parallel
peers there) and the interleaved schedule's model chunks (``model0``, ``model1`` in each file), which the
Hugging Face export reads back into the single-process model.
"""
import pytest
import torch

from tests.training.parallel_harness import LLAMA_STYLE, TINY_GPT, ds_config_flags, train
from tools.checkpoint.loader import load_full_state_dict

pytestmark = pytest.mark.multiprocess

LEGACY = ["--ckpt-format", "torch"]
CP2 = LLAMA_STYLE + ["--context-parallel-size", "2"]
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _resume_matches(tmp_path, extra: list[str], world: int) -> dict[str, torch.Tensor]:
    """Returns the uninterrupted run's final weights; the resumed run's equal them."""
    full, full_params, _ = train(TINY_GPT + extra, world)
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--save-interval", "5"]
    first, _, _ = train(TINY_GPT + extra + save + ["--exit-interval", "5"], world)
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    resumed, params, _ = train(TINY_GPT + extra + save, world)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for it in range(6, 11):
        assert resumed[it] == pytest.approx(full[it], rel=1e-6, abs=0), f"iteration {it}"
    for name, ref in full_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    return full_params


def test_resume_pp2_dp2_is_exact(tmp_path):
    _resume_matches(tmp_path, ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.1"], 4)


def test_resume_zero3_dp2_is_exact(tmp_path):
    _resume_matches(tmp_path, ds_config_flags(tmp_path, 3, offload=True), 2)


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
@pytest.mark.parametrize("mesh", ["cp2", "vpp2"])
def test_legacy_format_resumes_context_parallel_and_model_chunks(mesh, engine, tmp_path):
    flags = {"cp2": CP2, "vpp2": VPP}[mesh] + LEGACY
    if engine == "zero3":
        flags = flags + ds_config_flags(tmp_path, 3, offload=True)
    final = _resume_matches(tmp_path, flags, 2)
    if engine == "ddp":  # Megatron's layout: the export tools read it back into the single-process model
        file = torch.load(tmp_path / "ckpt" / "iter_0000010" / ("mp_rank_00" if mesh == "cp2" else "mp_rank_00_001")
                          / "model_optim_rng.pt", weights_only=True)
        assert [k for k in file if k.startswith("model")] == (["model"] if mesh == "cp2" else ["model0", "model1"])
        assert len(file["rng_state"]) == (2 if mesh == "cp2" else 1)  # one per data x context-parallel rank
        _, exported = load_full_state_dict(str(tmp_path / "ckpt"), progress=lambda msg: None)
        assert exported.keys() == final.keys()
        for name, ref in final.items():
            torch.testing.assert_close(exported[name], ref, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
