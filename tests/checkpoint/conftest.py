"""Checkpoints saved once per session by several ranks, shared by the checkpoint tests."""
import pytest

from tests.checkpoint.common import MESHES, save_worker, unpack
from tests.dist_utils import run_distributed


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Both tiny models saved at iteration 3 under each mesh by 4 ranks: (root, per-rank snapshots).

    Checkpoints lie in ``root/<mesh>/<model>``; snapshot keys are (mesh, model).
    """
    root = str(tmp_path_factory.mktemp("saved"))
    return root, [unpack(r) for r in run_distributed(save_worker, 4, root, MESHES)]
