"""TP / PP / DP meshes train exactly like one process (fp32, dropout off): losses and weights within 1e-5."""
import functools

import pytest
import torch

from tests.training.parallel_harness import LLAMA_STYLE, TINY_GPT, train

pytestmark = pytest.mark.multiprocess


@functools.lru_cache(maxsize=None)
def _reference(extra: tuple[str, ...]):
    return train(TINY_GPT + list(extra), 1)


def _check(extra: list[str], mesh: list[str], world: int):
    ref_losses, ref_params, _ = _reference(tuple(extra))
    losses, params, outs = train(TINY_GPT + extra + mesh, world)
    assert sorted(losses) == list(range(1, 11))
    for it, ref in ref_losses.items():
        assert losses[it] == pytest.approx(ref, rel=1e-5), f"iteration {it}"
    assert ref_losses[10] < ref_losses[1]  # it did train
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # Tied embedding: the last stage's copy stays equal to the first stage's.
    for o in outs:
        if o["shared"] is not None:
            first = next(x for x in outs if x["pp"] == 0 and x["tp"] == o["tp"] and x["dp"] == o["dp"])
            torch.testing.assert_close(o["shared"], first["shared"], rtol=0, atol=0)


MESHES = {
    "tp2": (["--tensor-model-parallel-size", "2"], 2),
    "pp2": (["--pipeline-model-parallel-size", "2"], 2),
    "dp2": ([], 2),
    "tp2pp2dp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 8),
}


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_matches_single_process(mesh):
    flags, world = MESHES[mesh]
    _check([], flags, world)


def test_tp2pp2dp2_with_full_recompute():
    flags, world = MESHES["tp2pp2dp2"]
    _check(["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
           flags, world)


def test_llama_style_gqa_tp2pp2():
    _check(LLAMA_STYLE, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4)
