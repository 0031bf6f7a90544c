"""benchmarks/max_scale.py: its size <-> layers arithmetic is the model's own parameter count, and the
report table states ratios from the attempts it is given."""
from __future__ import annotations

import os
import sys

from megatron.core.transformer_config import TransformerConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import max_scale  # noqa: E402


def _count(layers: int) -> int:
    cfg = TransformerConfig(num_layers=layers, hidden_size=max_scale.HIDDEN, num_attention_heads=max_scale.HEADS,
                            ffn_hidden_size=max_scale.FFN, seq_length=max_scale.SEQ,
                            padded_vocab_size=max_scale.VOCAB, untie_embeddings_and_output_weights=True)
    return cfg.num_parameters()


def test_params_of_layers_is_the_model_count():
    for layers in (1, 18, 69):
        assert max_scale.params_of(layers) == _count(layers)


def test_issue_sizes_map_to_their_layer_counts():
    # The DeepSpeed capacity figures of the issue: 0.74B, 1.04B, 1.54B, 1.79B; our goal 3.6B.
    assert [max_scale.layers_for(b) for b in (0.74, 1.04, 1.54, 1.79, 3.6)] == [12, 18, 28, 33, 69]
    assert abs(max_scale.params_of(69) / 1e9 - 3.607) < 1e-3


def test_table_ratios():
    ours = [max_scale.Attempt("ours", "nvme", 69, max_scale.params_of(69), ok=True, step_s=[300.0, 200.0, 220.0],
                              peak_mem_gib=18.0, peak_disk_gib=41.0)]
    ds = [{"offload": "nvme", "layers": 33, "params": max_scale.params_of(33), "ok": True, "s_per_step": "240",
           "peak_mem_gib": 22.4, "disk_gib": 36, "source": "cached"}]
    compare = [max_scale.Attempt("ours", "nvme", 18, max_scale.params_of(18), ok=True, step_s=[90.0, 50.0, 60.0]),
               max_scale.Attempt("deepspeed", "nvme", 18, max_scale.params_of(18), ok=True,
                                 step_s=[150.0, 110.0, 130.0])]
    text = max_scale.table(ours, ds, compare)
    assert "| ours | nvme | 69 | 3.61 | yes | 210.0 |" in text  # median of the steps after the first
    assert "ours 3.61B, DeepSpeed 1.79B (2.01x)" in text
    assert "| 2.18x |" in text  # median(110, 130) / median(50, 60)
