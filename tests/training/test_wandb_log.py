"""--wandb-project: the scalars of the log line reach one W&B run, written by the last rank (offline: no network,
the run stays on disk), and a missing wandb package is one line naming pip install wandb."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron.training.arguments import ConfigError, parse_args
from tests.dist_utils import run_distributed
from tests.training.parallel_harness import TINY_GPT

WANDB = ["--wandb-project", "ptm-test", "--wandb-exp-name", "tiny"]


def test_missing_wandb_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="^--wandb-project needs the wandb package, which is not installed: "
                                          "pip install wandb$"):
        parse_args(TINY_GPT + WANDB, world_size=1)
    with pytest.raises(ConfigError, match="--wandb-project needs --wandb-exp-name"):
        parse_args(TINY_GPT + WANDB[:2], world_size=1)


def _train(rank, world, argv):
    from pretrain_gpt import main
    return main(argv).losses


def _records(path: Path):
    """The protobuf records of a run's .wandb file (a LevelDB-style log: 32 KiB blocks of chunks with a 7-byte
    header, checksum, length, type), read here because wandb ships no reader."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, payload = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # the block's zero padding
            pos += left
            continue
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def _history(path: Path) -> dict[int, dict]:
    rows = {}
    for record in _records(path):
        if record.WhichOneof("record_type") == "history":
            rows[record.history.step.num] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                             for item in record.history.item}
    return rows


@pytest.mark.multiprocess
def test_an_offline_run_holds_the_logged_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    argv = TINY_GPT + WANDB + ["--wandb-save-dir", str(tmp_path / "wb"), "--log-interval", "2",
                               "--log-batch-size-to-tensorboard"]
    losses = run_distributed(_train, 2, argv, timeout=240)[-1]
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # one rank logs
    history = _history(runs[0])
    assert sorted(history) == [2, 4, 6, 8, 10]
    for step, row in history.items():
        assert row["lm loss"] == pytest.approx((losses[step - 1] + losses[step]) / 2, rel=1e-6)  # the interval's
        assert row["batch-size"] == 8 and 0 < row["learning-rate"] <= 5e-3 and row["loss-scale"] == 1.0
        for key in ("grad-norm", "tokens-per-second", "TFLOPs", "memory/rss GiB", "memory/peak rss GiB"):
            assert row[key] > 0, (step, key)
