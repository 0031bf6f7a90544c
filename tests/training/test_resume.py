"""Save at iteration 5, resume in fresh processes: iterations 6-10 equal the uninterrupted run exactly."""
import pytest

from tests.training.parallel_harness import TINY_GPT, ds_config_flags, train

pytestmark = pytest.mark.multiprocess


def _resume_matches(tmp_path, extra: list[str], world: int):
    full, _, _ = train(TINY_GPT + extra, world)
    save = ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--save-interval", "5"]
    first, _, _ = train(TINY_GPT + extra + save + ["--exit-interval", "5"], world)
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    resumed, _, _ = train(TINY_GPT + extra + save, world)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for it in range(6, 11):
        assert resumed[it] == pytest.approx(full[it], rel=1e-6, abs=0), f"iteration {it}"


def test_resume_pp2_dp2_is_exact(tmp_path):
    _resume_matches(tmp_path, ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.1"], 4)


def test_resume_zero3_dp2_is_exact(tmp_path):
    _resume_matches(tmp_path, ds_config_flags(tmp_path, 3, offload=True), 2)
