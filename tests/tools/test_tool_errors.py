"""Every tool refuses missing or malformed input in one line (``prog: error: ...``) with exit status 2."""
from __future__ import annotations

import pytest

from ptm_launch.runner import main as launch_main
from ptm_planner.cli import main as plan_main
from tools.checkpoint.convert_from_hf import main as from_hf_main
from tools.checkpoint.convert_to_hf import main as to_hf_main
from tools.checkpoint.zero_to_fp32 import main as zero_to_fp32_main
from tools.make_sample_corpus import main as corpus_main
from tools.merge_datasets import main as merge_main
from tools.plot_run import main as plot_main
from tools.train_tokenizer import main as tokenizer_main
from zero_cache.checkpoint.consolidate import main as consolidate_main

LOG_LINE = (" iteration       10/      20 | consumed samples:          320 | elapsed time per iteration (ms): 1196.6 | "
            "lm loss: 7.847961E+00 | tokens per second: 6848.8 | TFLOPs: 0.14 |\n")


@pytest.fixture
def inputs(tmp_path):
    """Bad inputs of every kind, by name."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "garbage.pt").write_bytes(b"garbage\x00\x01")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "args.json").write_text('{"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, '
                                        '"seq_length": 16, "padded_vocab_size": 128}')
    (tmp_path / "badtracker").mkdir()
    (tmp_path / "badtracker" / "latest_checkpointed_iteration.txt").write_text("abc")
    (tmp_path / "zc" / "global_step1").mkdir(parents=True)
    (tmp_path / "zc" / "latest").write_text("global_step1")
    (tmp_path / "zc" / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"garbage")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{not json")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notutf8").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "damaged.log").write_text(LOG_LINE.replace("1196.6", "abc"))
    (tmp_path / "good.log").write_text(LOG_LINE)
    return tmp_path


CASES = [
    ("ptm-consolidate", consolidate_main, ["{t}/empty", "{t}/out"], "has no 'latest' file naming a checkpoint"),
    ("ptm-consolidate", consolidate_main, ["{t}/empty", "{t}/out", "--tag", "nope"], "is missing"),
    ("zero_to_fp32.py", zero_to_fp32_main, ["{t}/missing", "{t}/out"], "{t}/missing does not exist"),
    ("zero_to_fp32.py", zero_to_fp32_main, ["{t}/empty", "{t}/out"], "{t}/empty holds no checkpoint"),
    ("zero_to_fp32.py", zero_to_fp32_main, ["{t}/afile", "{t}/out"], "{t}/afile is a file"),
    ("zero_to_fp32.py", zero_to_fp32_main, ["{t}/badtracker", "{t}/out"], "should hold an iteration number"),
    ("zero_to_fp32.py", zero_to_fp32_main, ["{t}/zc", "{t}/out"], "is not a readable checkpoint file"),
    ("zero_to_fp32.py", zero_to_fp32_main, ["{t}/empty", "{t}/out", "--tag", "nope"], "holds no checkpoint tagged"),
    ("convert_to_hf.py", to_hf_main, ["--load", "{t}/missing", "--output", "{t}/out"], "holds no complete checkpoint"),
    ("convert_to_hf.py", to_hf_main, ["--state-dict", "{t}/garbage.pt", "--args-from", "{t}/list.json", "--output",
                                      "{t}/out"], "holds a JSON list"),
    ("convert_to_hf.py", to_hf_main, ["--state-dict", "{t}/garbage.pt", "--args-from", "{t}/args.json", "--output",
                                      "{t}/out"], "cannot read checkpoint file {t}/garbage.pt"),
    ("convert_from_hf.py", from_hf_main, ["--input", "{t}/missing", "--output", "{t}/out"], "does not exist"),
    ("convert_from_hf.py", from_hf_main, ["--input", "{t}/hf", "--output", "{t}/out"], "config.json"),
    ("merge_datasets.py", merge_main, ["--input", "{t}/missing", "--output-prefix", "{t}/out/x"], "not found"),
    ("merge_datasets.py", merge_main, ["--input", "{t}/empty", "--output-prefix", "{t}/out/x"], "no .bin/.idx pair"),
    ("train_tokenizer.py", tokenizer_main, ["--input", "{t}/missing.jsonl", "--output-dir", "{t}/out"], "no such file"),
    ("train_tokenizer.py", tokenizer_main, ["--input", "{t}/empty.jsonl", "--output-dir", "{t}/out"], "holds no text"),
    ("train_tokenizer.py", tokenizer_main, ["--input", "{t}/empty.jsonl", "--output-dir", "{t}/afile/out"],
     "{t}/afile/out: a file is in the way of a directory"),
    ("make_sample_corpus.py", corpus_main, ["--output", "{t}/afile/corpus.jsonl"], "a file is in the way"),
    ("plot_run.py", plot_main, ["{t}/missing.log"], "cannot read the log"),
    ("plot_run.py", plot_main, ["{t}/damaged.log"], "{t}/damaged.log line 1: a field is not a number"),
    ("plot_run.py", plot_main, ["{t}/good.log", "-o", "{t}/afile/run.png"], "a file is in the way of a directory"),
    ("plan_memory.py", plan_main, ["--size", "125m", "--nvme-path", "{t}/afile/nvme"], "{t}/afile, where it would be"),
]


@pytest.mark.parametrize("prog, main, argv, message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_status_2(inputs, capsys, prog, main, argv, message):
    with pytest.raises(SystemExit) as exited:
        code = main([a.format(t=inputs) for a in argv])
        raise SystemExit(code)
    _, err = capsys.readouterr()
    assert exited.value.code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"{prog}: error: ") and message.format(t=inputs) in line, line


def test_launcher_env_file_that_is_not_text(inputs, capsys, monkeypatch):
    monkeypatch.setenv("PTM_ENV_FILE", str(inputs / "notutf8"))
    assert launch_main(["train.py"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"ptm-launch: error: {inputs / 'notutf8'}: cannot be read (not UTF-8 text")
