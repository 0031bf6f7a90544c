"""TP / PP / DP meshes train exactly like one process (fp32, dropout off): losses and weights within 1e-5."""
import pytest

from tests.training.parallel_harness import LLAMA_STYLE, MESHES, check_matches_reference

pytestmark = pytest.mark.multiprocess




@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_matches_single_process(mesh):
    flags, world = MESHES[mesh]
    check_matches_reference([], flags, world)


def test_tp2pp2dp2_with_full_recompute():
    flags, world = MESHES["tp2pp2dp2"]
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    check_matches_reference(recompute, flags, world)


def test_llama_style_gqa_tp2pp2():
    tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    check_matches_reference(LLAMA_STYLE, tp2pp2, 4)
