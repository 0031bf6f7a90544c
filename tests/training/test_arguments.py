"""parse_args: one frozen, typed Config, validated before start-up; the checkpoint 'args' derived from it."""
import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_cache
from megatron.core import parallel_state as ps
from megatron.training import zero_config
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.backends.base import Backend, BackendStepResult
from megatron.training.backends.ddp import MegatronBackend
from megatron.training.backends.zero import ZeroBackend, step_result
from tests.training.parallel_harness import TINY_GPT
from zero_cache import StepResult, ZeroCacheConfig

ROOT = Path(__file__).resolve().parents[2]


def _with(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def _without(argv, flag):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


@pytest.mark.parametrize("extra, expected", [
    (["--lr-warmup-iters", "10", "--lr-decay-iters", "10"], "warm-up samples \\(80\\) must be >= 0 and below"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "--lr-warmup-iters and --lr-warmup-fraction are "
                                                                "exclusive"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in"),
    (["--weight-decay-incr-style", "linear"], "needs both --start-weight-decay and --end-weight-decay"),
    (["--lr-decay-iters", "0"], "decay length must be > 0 samples"),
])
def test_bad_schedule_fails_in_parse_args(extra, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_args(_without(TINY_GPT, "--lr-warmup-iters") + extra, world_size=1)


def test_bad_model_shape_fails_in_parse_args():
    with pytest.raises(ConfigError, match="--hidden-size 30 is not divisible by --num-attention-heads 4"):
        parse_args(_with(TINY_GPT, "--hidden-size", "30"), world_size=1)
    with pytest.raises(ConfigError, match="--seq-length 32 exceeds --max-position-embeddings 16"):
        parse_args(_with(TINY_GPT, "--seq-length", "32"), world_size=1)


def test_context_parallel_kinds_are_checked_in_parse_args():
    """The ring's and the all-gather's block kernels take no dropout; the all-to-all splits the heads."""
    cp2 = _with(TINY_GPT, "--attention-dropout", "0.1") + ["--context-parallel-size", "2"]
    for kind in ("p2p", "allgather"):
        with pytest.raises(ConfigError, match=f"--attention-dropout 0.1 with --cp-comm-type {kind} .* use "
                                              "--cp-comm-type a2a"):
            parse_args(cp2 + ["--cp-comm-type", kind], world_size=2)
    three_heads = _with(_with(TINY_GPT, "--num-attention-heads", "3"), "--hidden-size", "48")
    with pytest.raises(ConfigError, match="--cp-comm-type a2a splits each tensor-parallel rank's 3 attention heads"):
        parse_args(three_heads + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], world_size=2)
    cfg = parse_args(three_heads + ["--context-parallel-size", "2", "--cp-comm-type", "allgather"], world_size=2)
    assert (cfg.parallel.cp_comm_type, cfg.parallel.context_parallel_size) == ("allgather", 2)


def test_bad_deepspeed_setup_fails_in_parse_args(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    argv = TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds), "--weight-decay-incr-style", "linear",
                       "--start-weight-decay", "0.0", "--end-weight-decay", "0.1"]
    with pytest.raises(ConfigError, match="not supported with --deepspeed"):
        parse_args(argv, world_size=1)
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(TINY_GPT + ["--deepspeed", "--deepspeed_config", str(tmp_path / "missing.json")], world_size=1)
    with pytest.raises(ConfigError, match="a directory; give the JSON file"):
        parse_args(TINY_GPT + ["--deepspeed", "--deepspeed_config", str(tmp_path)], world_size=1)
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(ConfigError, match="'train_micro_batch_size_per_gpu': 4 disagrees with --micro-batch-size"):
        parse_args(TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds)], world_size=1)
    # The flags' optimizer trains: a JSON optimizer or clipping that says otherwise is an error, not an override.
    argv = TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds)]
    lr = parse_args(TINY_GPT, world_size=1).optimizer.lr
    for block, message in (
            ({"gradient_clipping": 123.0}, "'gradient_clipping': 123.0 disagrees with --clip-grad"),
            ({"optimizer": {"type": "AdamW", "params": {"lr": lr * 2}}},
             f"'optimizer.params.lr': {lr * 2} disagrees with --lr"),
            ({"optimizer": {"params": {"weight_decay": 0.5}}},
             "'optimizer.params.weight_decay': 0.5 disagrees with --weight-decay"),
            ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "adds weight decay to the gradient")):
        ds.write_text(json.dumps(block))
        with pytest.raises(ConfigError, match=message):
            parse_args(argv, world_size=1)
    # Blocks of the wrong JSON type are one error naming the file, not a TypeError.
    for text, message in (("[]", "must hold a JSON object"), ('{"bf16": true}', "'bf16' in .* must be a JSON object"),
                          ('{"fp16": {"enabled": "no"}}', "'fp16.enabled' in .* must be true or false"),
                          ('{"gradient_clipping": true}', "'gradient_clipping': true disagrees with --clip-grad"),
                          ('{"optimizer": "adam"}', "'optimizer' in .* must be an object")):
        ds.write_text(text)
        with pytest.raises(ConfigError, match=message):
            parse_args(argv, world_size=1)
    ds.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match=f"'{ds}' is not valid JSON"):
        parse_args(argv, world_size=1)
    ds.write_text('{"zero_optimization": {"stage": 3}, "zero_optimization": {"stage": 1}}')
    with pytest.raises(ConfigError, match="gives 'zero_optimization' twice in one object"):
        parse_args(argv, world_size=1)
    ds.write_text('{"zero_optimization": "x"}')
    with pytest.raises(ConfigError, match="'zero_optimization' in .* must be a JSON object"):
        parse_args(argv + ["--zero-stage", "2"], world_size=1)
    ds.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": lr}}}))
    assert parse_args(argv, world_size=1).optimizer.lr == lr  # agreeing keys (and DeepSpeed's Adam) are fine
    ds.write_text(json.dumps({"zero_optimization": {"sub_grup_size": 10}}))
    with pytest.raises(ConfigError, match="sub_group_size"):
        parse_args(TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds)], world_size=1)


def _configs(obj, path="cfg"):
    """(path, value) of every field, recursively through dataclasses and containers."""
    yield path, obj
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _configs(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _configs(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _configs(v, f"{path}[{k!r}]")


def test_configs_are_frozen_dataclasses_without_a_namespace():
    cfg = parse_args(TINY_GPT + ["--tensor-model-parallel-size", "2"], world_size=4)
    values = list(_configs(cfg))
    assert not [p for p, v in values if isinstance(v, argparse.Namespace)]
    nested = [(p, v) for p, v in values if dataclasses.is_dataclass(v)]
    assert len(nested) == 12  # Config and its eleven configs
    assert all(v.__dataclass_params__.frozen for _, v in nested), [p for p, v in nested]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.micro_batch_size = 4


def test_resolved_values():
    cfg = parse_args(TINY_GPT + ["--tensor-model-parallel-size", "2", "--lr-warmup-iters", "3",
                                 "--checkpoint-activations", "--bf16"], world_size=4)
    assert (cfg.parallel.data_parallel_size, cfg.parallel.num_microbatches) == (2, 2)
    s = cfg.scheduler
    # in samples, as Megatron counts them: iterations x the global batch of 8
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.wd_incr_steps, s.lr_decay_style) == (24, 80, 80, "cosine")
    assert (s.max_lr, s.min_lr, s.start_wd, s.end_wd) == (5e-3, 5e-4, 0.1, 0.1)
    assert (cfg.model.precision, cfg.model.recompute_granularity) == ("bf16", "full")
    assert cfg.optimizer.bf16 and not cfg.deepspeed.enabled
    model = cfg.model.transformer_config(100, cfg.parallel.tensor_model_parallel_size)
    assert model.padded_vocab_size == 128  # a multiple of 64 x TP 2
    assert model.gradient_accumulation_fusion  # Megatron's default
    cfg = parse_args(TINY_GPT + ["--no-gradient-accumulation-fusion"], world_size=1)
    assert not cfg.model.transformer_config(100, 1).gradient_accumulation_fusion


def test_checkpoint_args_keep_megatron_names():
    cfg = parse_args(TINY_GPT + ["--tensor-model-parallel-size", "2", "--num-query-groups", "2",
                                 "--checkpoint-activations"], world_size=4)
    args = cfg.to_megatron_args(cfg.model.transformer_config(100, 2))
    expected = {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 128, "num_attention_heads": 4,
                "num_query_groups": 2, "group_query_attention": True, "kv_channels": 8, "seq_length": 16,
                "max_position_embeddings": 16, "padded_vocab_size": 128, "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 1, "data_parallel_size": 2, "global_batch_size": 8,
                "untie_embeddings_and_output_weights": False, "add_bias_linear": True, "normalization": "LayerNorm",
                "position_embedding_type": "learned_absolute", "swiglu": False, "layernorm_epsilon": 1e-5,
                "norm_epsilon": 1e-5, "params_dtype": "fp32", "recompute_granularity": "full", "lr": 5e-3,
                "train_iters": 10, "tokenizer_type": "NullTokenizer", "vocab_size": 100, "data_path": None}
    assert {k: args[k] for k in expected} == expected
    assert all(isinstance(v, (int, float, str, bool, type(None))) for v in args.values())


@pytest.mark.multiprocess
def test_tokenizer_and_data_flags_import_without_torch():
    # tools/preprocess_data.py (and its spawned workers) use only these two groups.
    code = ("import sys, megatron.training.arguments.tokenizer, megatron.training.arguments.data; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_both_backends_implement_the_backend_interface():
    assert issubclass(MegatronBackend, Backend) and issubclass(ZeroBackend, Backend)
    assert Backend.__abstractmethods__ == {"zero_grad", "scale_loss", "backward_pass", "finish_grad_sync", "step",
                                           "checkpoint_states", "checkpoint_layout", "save_legacy_checkpoint",
                                           "load_legacy_checkpoint", "memory_tiers", "comm_stats",
                                           "local_state_dict"}
    assert not MegatronBackend.__abstractmethods__ and not ZeroBackend.__abstractmethods__


def test_engine_step_result_becomes_the_trainers():
    assert step_result(StepResult(grad_norm=0.5, skipped=False, loss_scale=8.0, lr=1e-3)) == \
        BackendStepResult(update_successful=True, grad_norm=0.5, loss_scale=8.0)
    skipped = step_result(StepResult(grad_norm=float("inf"), skipped=True, loss_scale=4.0, lr=1e-3))
    assert not skipped.update_successful and skipped.grad_norm == float("inf") and skipped.loss_scale == 4.0


def test_the_deepspeed_json_is_read_and_parsed_once_into_the_config(tmp_path, monkeypatch):
    calls = {"read_json": 0, "parse_config": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    for name in calls:
        monkeypatch.setattr(zero_config, name, counted(name, getattr(zero_config, name)))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    cfg = parse_args(TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds), "--zero-stage", "3"], world_size=2)
    assert calls == {"read_json": 1, "parse_config": 1}
    z = cfg.zero_cache
    assert isinstance(z, ZeroCacheConfig) and z.zero_optimization.stage == 3  # --zero-stage wins
    assert (z.train_micro_batch_size_per_gpu, z.gradient_accumulation_steps, z.train_batch_size) == \
        (cfg.parallel.micro_batch_size, cfg.parallel.num_microbatches, cfg.parallel.global_batch_size)
    assert parse_args(TINY_GPT, world_size=1).zero_cache is None


def test_the_zero_backend_hands_the_parsed_config_to_the_engine(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    cfg = parse_args(TINY_GPT + ["--deepspeed", "--deepspeed_config", str(ds)], world_size=1)
    given = {}

    class Stop(Exception):
        pass

    def initialize(model, config, **kwargs):
        given["config"] = config
        raise Stop
    monkeypatch.setattr(zero_cache, "initialize", initialize)
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda with_context_parallel=False: None)
    monkeypatch.setattr(ps, "get_model_parallel_group", lambda: None)
    model = torch.nn.Linear(2, 2)
    model.shared_embedding_weight = lambda: None
    with pytest.raises(Stop):
        ZeroBackend(cfg, model)
    assert given["config"] is cfg.zero_cache
