"""What a newcomer reads first: every size's parameter count in the sizes table (from its shape, as the trainer
counts it), and the sequence length and micro-batch a plan is for, with where each came from."""
from __future__ import annotations

import json
import re

import pytest

from ptm_planner import sizes
from ptm_planner.cli import EXIT_FITS, main, request_from_args
from ptm_planner.sizes import SIZES, get_size, table

BOX = ["--device", "cpu", "--nproc-per-node", "2", "--host-memory-gib", "24", "--nvme-free-gib", "70"]


def test_the_table_states_every_sizes_parameter_count_as_the_trainer_counts_it():
    rows = {line.split()[0]: line.split()[1] for line in table().splitlines()[1:]}
    assert rows.keys() == {s.name for s in SIZES}
    for size in SIZES:
        model = request_from_args(["--size", size.name, *BOX])[0].model  # the planner's (and trainer's) model
        assert size.num_parameters() == model.num_parameters(), size.name
        assert size.num_parameters(active=True) == model.num_parameters(active=True), size.name
    # By hand, 1.3b: 24 x (attention 4h^2 + 4h, MLP 2hf + f + h, two LayerNorms 4h) + words 50304 x h + 256
    # positions x h + the final LayerNorm 2h, h = 2048, f = 8192.
    h, f = 2048, 8192
    assert get_size("1.3b").num_parameters() == 24 * (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h) \
        + 50304 * h + 256 * h + 2 * h == 1_312_149_504
    # The names after the AngelPTM paper are not parameter counts: the table says what each is.
    assert (rows["1.3b"], rows["28"], rows["55"], rows["moe-8x1.3b"]) == ("1.31B", "21.35B", "55.18B", "6.95B/2.12B")


def test_start_sh_fields_are_unchanged(capsys):
    """examples/start.sh reads `row`, `moe-args` and `seq-length`: the count is only in the table."""
    for argv, out in ((["row", "28"], "26 8192 128 32768 38"), (["seq-length", "1.3b-32k"], "32768"),
                      (["moe-args", "moe-tiny"], "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 512 "
                                                 "--moe-aux-loss-coeff 1e-2")):
        assert sizes.main(argv) == 0
        assert capsys.readouterr().out == out + "\n"


def test_ptm_plan_lists_the_sizes(capsys):
    assert main(["--list-sizes"]) == EXIT_FITS
    assert capsys.readouterr().out == table() + "\n"


def _planned_at(argv: list[str], capsys) -> tuple[str, dict]:
    capsys.readouterr()
    assert main(BOX + argv) == EXIT_FITS
    text = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("planned at: ")]
    assert len(text) == 1
    main(BOX + argv + ["--json"])
    return text[0], json.loads(capsys.readouterr().out)["planned_at"]


@pytest.mark.parametrize("argv, line, sources", [
    (["--size", "1.3b"], "planned at: sequence length 256 (size 1.3b's default; give --seq-length to plan another), "
     "micro-batch 4 (size 1.3b's default; give --micro-batch-size to plan another)", ("size", "size")),
    (["--size", "125m", "--seq-length", "512", "--micro-batch-size", "2"],
     "planned at: sequence length 512 (given as --seq-length), micro-batch 2 (given as --micro-batch-size)",
     ("flag", "flag")),
    (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"],
     "planned at: sequence length 256 (the planner's default; give --seq-length to plan another), micro-batch 1 "
     "(the planner's default; give --micro-batch-size to plan another)", ("default", "default")),
])
def test_the_plan_says_what_it_planned_at_and_why(argv, line, sources, capsys):
    text, planned = _planned_at(argv, capsys)
    assert text == line
    assert (planned["seq_length_from"], planned["micro_batch_size_from"]) == sources
    assert planned["text"] == line


def test_a_lowered_micro_batch_and_a_searched_length_are_named(capsys):
    text, planned = _planned_at(["--size", "28", "--host-memory-gib", "48", "--nvme-free-gib", "4000"], capsys)
    lowered = re.search(r"micro-batch 38 \(size 28's default; give --micro-batch-size to plan another; lowered to "
                        r"(\d+) to fit\)$", text)
    assert lowered and 1 <= int(lowered.group(1)) < 38, text
    text, planned = _planned_at(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                 "--longest-seq"], capsys)
    assert planned["seq_length_from"] == "longest-seq"
    assert f"sequence length {planned['seq_length']} (the longest that fits, found by --longest-seq)" in text


def test_in_memory_snapshots_are_counted_in_host_memory(capsys):
    """--non-persistent-ckpt-type local: each rank's shard of fp32 parameters and both Adam moments, twice while
    the next snapshot is written, and twice again with --replication's copy of a peer's."""
    def plan(*extra: str) -> dict:
        assert main(["--size", "default", *BOX, "--offload", "none", "--json", *extra]) == EXIT_FITS
        return json.loads(capsys.readouterr().out)

    plain, own, both = plan(), plan("--non-persistent-ckpt-type", "local"), plan(
        "--non-persistent-ckpt-type", "local", "--replication")
    shard = -(-sizes.get_size("default").num_parameters() // 2)  # DP 2 (chunk padding adds a little)
    snapshot = [p["stages"][0]["nonstate"]["snapshots"] for p in (plain, own, both)]
    assert snapshot[0] == 0 and snapshot[2] == 2 * snapshot[1]
    assert 2 * 12 * shard <= snapshot[1] <= 2 * 12 * shard * 1.05
    assert both["stages"][0]["need"]["host"] == plain["stages"][0]["need"]["host"] + snapshot[2]
