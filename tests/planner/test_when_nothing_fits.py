"""The planner when nothing fits: one line with what is needed against what exists and the flags to change,
no '0.0 KiB' budgets, and the README's --largest example, which must run (and write its files) on any machine."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from ptm_planner.cli import EXIT_DOES_NOT_FIT, EXIT_FITS, main

ROOT = Path(__file__).resolve().parents[2]
BOX = ["--device", "cpu", "--nproc-per-node", "2", "--host-memory-gib", "24", "--nvme-free-gib", "70"]
HUGE = ["--hidden-size", "8192", "--num-attention-heads", "64", "--ffn-hidden-size", "32768"]


def readme_plan_examples() -> list[list[str]]:
    """The README's ``ptm-plan`` commands (continuation lines joined, comments dropped), as arguments."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in text.splitlines() if line.startswith("ptm-plan ")]
    assert len(commands) == 2 and "--largest" in commands[1], commands
    return [words[1:] for words in commands]


def test_largest_when_not_one_layer_fits_is_one_line(capsys):
    code = main(HUGE + ["--largest"] + BOX)
    out, err = capsys.readouterr()
    assert code == EXIT_DOES_NOT_FIT and out == ""
    (line,) = err.splitlines()
    assert line.startswith("plan_memory.py: nothing of this family fits: 1 layer(s) (")
    assert re.search(r"need [\d.]+ GiB host memory per node \(24\.00 GiB given\)", line), line
    assert "--host-memory-gib" in line and "--hidden-size" in line and "0.0 KiB" not in line


def test_host_memory_taken_before_any_state_says_how_much(capsys):
    """With 12 GiB, one layer's activations and gathered parameters alone exceed a process's share: said with
    both amounts, not as states that 'exceed 0.0 KiB'."""
    code = main(HUGE + ["--num-layers", "1"] + BOX + ["--host-memory-gib", "12"])
    out, _ = capsys.readouterr()
    assert code == EXIT_DOES_NOT_FIT
    assert "0.0 KiB" not in out and "exceed" not in out, out
    assert re.search(r"host memory: activations, gathered parameters, buffers and device-tier states take [\d.]+ "
                     r"GiB per process before any model state, more than the 5\.40 GiB a process gets \(90% of "
                     r"12\.00 GiB / 2 processes\)", out), out


def test_states_that_do_not_fit_beside_them_say_what_is_left(capsys):
    code = main(HUGE + ["--num-layers", "1"] + BOX)
    out, _ = capsys.readouterr()
    assert code == EXIT_DOES_NOT_FIT
    assert re.search(r"host memory: the states that must stay on the host exceed the [\d.]+ GiB per process left "
                     r"of 10\.80 GiB \(90% of 24\.00 GiB / 2 processes\)", out), out


def test_readme_examples_run_here_and_write_the_files_the_next_line_uses(tmp_path, monkeypatch, capsys):
    """Also on a CPU-only machine: the hardware flags describe the GPU node the plan is for."""
    monkeypatch.chdir(tmp_path)
    fits, largest = readme_plan_examples()
    assert main(fits) == EXIT_FITS
    assert main(largest) == EXIT_FITS, capsys.readouterr()
    flags = (tmp_path / "args.txt").read_text().split()
    assert json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]["stage"] == 3
    layers = int(flags[flags.index("--num-layers") + 1])
    assert layers > 1 and flags[flags.index("--hidden-size") + 1] == "8192" and "--bf16" in flags
