"""In-memory snapshots (--non-persistent-ckpt-type local): a run killed at any moment resumes from the newest
complete snapshot, bit-identical to the uninterrupted run, without a checkpoint in storage. The copies on
other hosts are tested across hosts in tests/launcher/test_multinode.py."""
from __future__ import annotations

import json
import os
import random
import re
import time

import psutil
import pytest

from megatron.training.arguments import ConfigError, parse_args
from tests.training.parallel_harness import TINY_GPT
from tests.training.run_trainer import losses, run, start

ITERS = 12


def _argv(tmp_path, snapshots: bool) -> list[str]:
    zero = {"zero_optimization": {"stage": 3, "allgather_bucket_size": 3000, "stage3_param_persistence_threshold": 64,
                                  "sub_group_size": 5000, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}}}
    (tmp_path / "ds.json").write_text(json.dumps(zero))
    argv = [a for a in TINY_GPT if a not in ("--train-iters", "10", "--log-interval", "5")]
    argv += ["--train-iters", str(ITERS), "--log-interval", "1", "--deepspeed", "--deepspeed_config",
             str(tmp_path / "ds.json")]
    if snapshots:  # storage only at the end: a restart can resume from the snapshots alone
        ckpt = str(tmp_path / "ckpt")
        argv += ["--save", ckpt, "--load", ckpt, "--save-interval", "1000", "--non-persistent-ckpt-type", "local",
                 "--non-persistent-save-interval", "2", "--non-persistent-local-ckpt-dir", str(tmp_path / "shm")]
    return argv


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    code, out = run(_argv(tmp_path_factory.mktemp("reference"), snapshots=False), nproc=2)
    assert code == 0, out
    return losses(out)


def _killed_after(argv: list[str], pattern: str, delay: float) -> dict[int, float]:
    """Train, SIGKILL torchrun and its ranks at once (as a host's power loss would) ``delay`` s after the first
    line matching ``pattern``; the losses printed until then."""
    proc = start(argv, nproc=2)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            break
    time.sleep(delay)
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.kill()
    proc.wait()
    return losses("".join(lines))


@pytest.mark.multiprocess
def test_killed_run_resumes_from_its_snapshot_exactly_and_reads_no_storage(tmp_path, reference):
    """ZeRO-3 with the optimizer states on SSD, 2 ranks; killed (SIGKILL, every rank) at a random moment after
    iteration 7, while the snapshot of 6 may be in flight: the restart resumes from 6 or 4 with the losses of
    the uninterrupted run to the last digit, and a clean end leaves no snapshot behind."""
    first = _killed_after(_argv(tmp_path, snapshots=True), r"iteration\s+7/", random.Random(0).uniform(0.0, 0.3))
    assert not os.path.exists(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    code, out = run(_argv(tmp_path, snapshots=True), nproc=2)
    assert code == 0, out
    restored = re.search(r"> restored iteration (\d+) from the in-memory snapshots of 1 host\(s\).*nothing read "
                         r"from --load", out)
    assert restored and int(restored[1]) in (4, 6), out
    second = losses(out)
    assert sorted(second) == list(range(int(restored[1]) + 1, ITERS + 1))
    for it, loss in {**first, **second}.items():
        assert loss == reference[it], f"iteration {it}"
    host_dirs = os.listdir(tmp_path / "shm")
    assert len(host_dirs) == 1 and os.listdir(tmp_path / "shm" / host_dirs[0]) == []


@pytest.mark.multiprocess
def test_a_damaged_snapshot_is_not_restored_and_the_checkpoint_in_storage_is(tmp_path, reference):
    """Checkpoints every 5 iterations and snapshots every 2, killed once the snapshot of 6 is complete (during
    step 7, which waits for it before its update); 16 bytes of one data file of that snapshot are flipped: every
    rank agrees it cannot be restored, none has changed a state, and the restart reads the checkpoint of 5
    under --load instead, with the uninterrupted losses."""
    argv = _argv(tmp_path, snapshots=True)
    argv[argv.index("--save-interval") + 1] = "5"
    _killed_after(argv, r"> snapshot of iteration 6 ", 0.0)
    (host,) = (tmp_path / "shm").iterdir()
    (snapshot,) = host.iterdir()  # the one before was removed once this one was complete
    data = sorted(snapshot.glob("__*_0.distcp"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 16] = bytes(b ^ 0xFF for b in raw[len(raw) // 2:len(raw) // 2 + 16])
    data.write_bytes(bytes(raw))
    code, out = run(argv, nproc=2)
    assert code == 0, out
    assert re.search(rf"> the in-memory snapshot of iteration {snapshot.name[5:].lstrip('0')} cannot be restored "
                     rf"\(.*{data.name} is corrupted.*\); reading --load", out), out
    assert "resuming at iteration 5" in out
    second = losses(out)
    assert sorted(second) == list(range(6, ITERS + 1))
    for it, loss in second.items():
        assert loss == reference[it], f"iteration {it}"


@pytest.mark.parametrize("extra, expected", [
    (["--non-persistent-ckpt-type", "global"], "--non-persistent-ckpt-type global: only 'local' is built here"),
    (["--non-persistent-ckpt-type", "local", "--save", "x"],
     "--non-persistent-ckpt-type local needs --non-persistent-save-interval and --non-persistent-local-ckpt-dir"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "5",
      "--non-persistent-local-ckpt-dir", "/dev/shm/x"], "--non-persistent-ckpt-type local needs --save DIR"),
    (["--replication"], "--non-persistent-save-interval / --non-persistent-local-ckpt-dir / --replication need "
                        "--non-persistent-ckpt-type local"),
])
def test_snapshot_flags_that_cannot_work_are_one_line(extra, expected):
    with pytest.raises(ConfigError) as e:
        parse_args(TINY_GPT + extra, world_size=1)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


def test_the_newest_snapshot_whose_every_file_survives_is_chosen():
    from megatron.training.checkpoint.snapshots import newest_complete

    def entry(iteration, token, files, expected=True):
        listed = ["__0_0.distcp", "__1_0.distcp"]
        return {"iteration": iteration, "token": token, "mesh": {"data_parallel_size": 2},
                "files": files + [".metadata", "checksums.json"] if expected else files,
                "expected": listed if expected else None}
    a4 = entry(4, "a", ["__0_0.distcp", "__1_0.distcp"])
    b6 = entry(6, "b", ["__0_0.distcp"])  # rank 1's file and its copy are both gone
    c6_other_save = entry(6, "c", ["__1_0.distcp"], expected=False)  # another save of iteration 6: no help
    assert newest_complete([a4, b6, c6_other_save], 0).iteration == 4
    b6_copy = entry(6, "b", ["__1_0.distcp"], expected=False)  # a peer host kept the copy
    found = newest_complete([a4, b6, b6_copy], 0)
    assert (found.iteration, found.token) == (6, "b")
    assert newest_complete([a4], 5) is None  # older than the checkpoint in storage
