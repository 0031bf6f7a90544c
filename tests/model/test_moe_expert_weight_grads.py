"""The grouped experts' weight gradients with gradient-accumulation fusion: each expert's product is multiplied
straight into its slice of the buffer the weight's sink hands over (zero_cache/weight_grad.py), the first pass over
what the buffer holds and later ones added to it, with no weight-sized tensor in between (as the dense layers')."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.core.moe.experts import ExpertWeights, _grouped_mm_works
from zero_cache.weight_grad import set_weight_grad_sink

E_LOCAL, OUT, IN = 3, 24, 16
COUNTS = [4, 0, 6]  # an expert no token chose still gets its (zero) gradient


class _Outputs(TorchDispatchMode):
    """Every tensor an op returns while active: (op, shape, data pointer)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(str(func), tuple(t.shape), t.data_ptr()) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor)]
        return out


def _experts() -> ExpertWeights:
    torch.manual_seed(0)
    return ExpertWeights(lambda e: lambda t: torch.nn.init.normal_(t, std=0.1), num_experts=E_LOCAL, first_expert=0,
                         num_local=E_LOCAL, out_features=OUT, in_features=IN, tp_size=1, tp_rank=0, tp_dim=1,
                         dtype=torch.float32)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-mm", "loop"])
def test_expert_weight_gradient_is_multiplied_into_the_buffer(grouped):
    if grouped and not _grouped_mm_works("cpu", torch.float32):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    experts = _experts()
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32) if grouped else None
    x = torch.randn(sum(COUNTS), IN)
    g = torch.randn(sum(COUNTS), OUT)
    # The reference: autograd's own weight gradient (no sink).
    (want,) = torch.autograd.grad(experts(x, COUNTS, offs, fuse=True), [experts.weight], g)

    # The engine's view: the weight's region inside a larger flat buffer, with junk where the first pass overwrites.
    flat = torch.full((5 + experts.weight.numel() + 7,), float("nan"))
    region = flat[5:5 + experts.weight.numel()].view_as(experts.weight)
    writes = []

    def sink(write):
        writes.append(len(writes) == 0)
        write(region, writes[-1])
    set_weight_grad_sink(experts.weight, sink)
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for passes in (1, 2):
        y = experts(x, COUNTS, offs, fuse=True)
        with _Outputs() as ops:
            y.backward(g)
        assert experts.weight.grad is None
        torch.testing.assert_close(region, passes * want, rtol=1e-6, atol=1e-6)
        # Nothing as large as one expert's gradient was made outside the buffer, and nothing was copied in.
        expert_numel = OUT * IN
        made = [(op, shape) for op, shape, ptr in ops.seen
                if torch.Size(shape).numel() >= expert_numel and not lo <= ptr < hi]
        assert made == [], f"weight-sized temporaries in the backward: {made}"
        assert not any("copy_" in op for op, _, _ in ops.seen)
    assert writes == [True, False]
    assert flat[:5].isnan().all() and flat[-7:].isnan().all()
