"""Fixtures of the CUDA tests (they run only where the skip in common.PYTESTMARK lets a test run)."""
from __future__ import annotations

import pytest
import torch

from tests.cuda.common import CUDA, STEPS, device_reference, strict_fp32


@pytest.fixture(scope="session", autouse=True)
def _strict_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32
    strict_fp32()
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def reference(_strict_fp32):
    """The single-process fp32 run on the GPU: (losses of STEPS steps, final weights on the host)."""
    return device_reference(CUDA, STEPS)
