"""A one-rank gloo group in the test process, for checks that need the mesh but not several ranks."""
import datetime

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.checkpoint.common import MESHES, save_worker, unpack
from tests.dist_utils import free_port, run_distributed


@pytest.fixture(scope="module")
def single_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Both tiny models saved at iteration 3 under each mesh by 4 ranks: (root, per-rank snapshots).

    Checkpoints lie in ``root/<mesh>/<model>``; snapshot keys are (mesh, model).
    """
    root = str(tmp_path_factory.mktemp("saved"))
    return root, [unpack(r) for r in run_distributed(save_worker, 4, root, MESHES)]
