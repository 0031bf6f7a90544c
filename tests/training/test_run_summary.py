"""Every training run ends with one ``run summary:`` line (scripts parse it: its fields and their order are
pinned here), and the logging rank keeps its log lines in a text file: --log-file, else <--save or
--tensorboard-dir>/logs/train-<UTC time>.log."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.training.arguments import ConfigError, parse_args
from megatron.training.run_log import LogFileError, RunLog, summary_line
from tests.training.parallel_harness import TINY_GPT
from tests.training.run_trainer import losses, run

DEFAULT_LOG = r"logs/train-\d{8}-\d{6}\.log"


def test_the_summary_line_format():
    saved = summary_line(first_iteration=21, last_iteration=30, final_loss=6.543219, tokens_per_s=1234.56,
                         elapsed_s=3725.9, checkpoint="/runs/a", log_path="/runs/a/logs/train-20250101-000000.log")
    assert saved == ("run summary: iterations 21-30 (10 this run) | final lm loss 6.5432E+00 | tokens/s 1234.6 | "
                     "elapsed 1:02:05 | checkpoint /runs/a at iteration 30 | "
                     "log /runs/a/logs/train-20250101-000000.log")
    nothing = summary_line(first_iteration=1, last_iteration=3, final_loss=None, tokens_per_s=None,
                           elapsed_s=90000, checkpoint=None, log_path=None)
    assert nothing == ("run summary: iterations 1-3 (3 this run) | final lm loss n/a | tokens/s n/a | "
                       "elapsed 25:00:00 | not saved: --save not set | log stdout only")


def test_the_run_log_tees_the_logging_rank_only(tmp_path, capsys):
    path = tmp_path / "deep" / "train.log"
    log = RunLog(str(path))
    log.print("> first")
    log.print("second")
    log.close()
    quiet = RunLog(str(tmp_path / "other.log"), enabled=False)  # another rank: prints and writes nothing
    quiet.print("not here")
    quiet.close()
    assert path.read_text() == "> first\nsecond\n"
    assert capsys.readouterr().out == "> first\nsecond\n"
    assert quiet.path is None and not (tmp_path / "other.log").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(LogFileError) as e:  # a file where its directory would be
        RunLog(str(tmp_path / "file" / "x.log"))
    assert str(e.value) == (f"cannot write the log file {tmp_path}/file/x.log (File exists: {tmp_path}/file); give "
                            "--log-file a path in a writable directory")


def _log_file(tmp_path, *flags):
    return parse_args(TINY_GPT + list(flags), world_size=1).log.log_file


def test_where_the_log_file_goes(tmp_path):
    assert _log_file(tmp_path) is None  # neither --save nor --tensorboard-dir: stdout only, as Megatron-LM
    assert re.fullmatch(re.escape(f"{tmp_path}/ckpt/") + DEFAULT_LOG, _log_file(tmp_path, "--save", f"{tmp_path}/ckpt",
                                                                                 "--tensorboard-dir", f"{tmp_path}/tb"))
    assert re.fullmatch(re.escape(f"{tmp_path}/tb/") + DEFAULT_LOG, _log_file(tmp_path, "--tensorboard-dir",
                                                                               f"{tmp_path}/tb"))
    assert _log_file(tmp_path, "--save", f"{tmp_path}/ckpt", "--log-file", "run.log") == "run.log"
    with pytest.raises(ConfigError, match=f"^--log-file {tmp_path} is a directory; give a file path, e.g. "):
        _log_file(tmp_path, "--log-file", str(tmp_path))


SUMMARY = re.compile(r"run summary: iterations (\d+)-(\d+) \((\d+) this run\) \| final lm loss (\S+) \| tokens/s "
                     r"([0-9.]+) \| elapsed (\d+:\d\d:\d\d) \| checkpoint (.+) at iteration (\d+) \| log (.+)")


@pytest.mark.multiprocess
def test_a_run_stopped_early_and_its_resume_each_end_with_a_summary_and_keep_a_log(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = TINY_GPT + ["--save", str(ckpt), "--load", str(ckpt), "--log-interval", "1"]
    code, out = run(argv + ["--exit-interval", "3"])  # stops at iteration 3 of 10
    assert code == 0, out
    first = SUMMARY.fullmatch(out.splitlines()[-1])
    assert first, out[-2000:]
    assert first.group(1, 2, 3, 7, 8) == ("1", "3", "3", str(ckpt), "3")
    assert float(first.group(4)) == pytest.approx(losses(out)[3], rel=1e-4)  # the last iteration's loss
    assert float(first.group(5)) > 0
    log = Path(first.group(9))
    assert re.fullmatch(re.escape(f"{ckpt}/") + DEFAULT_LOG, str(log))
    lines = log.read_text().splitlines()
    assert lines[0].startswith("> model: ") and lines[-1] == first.group(0)
    assert sorted(losses(log.read_text())) == [1, 2, 3] and set(lines) <= set(out.splitlines())

    code, out = run(argv + ["--log-file", str(tmp_path / "resumed.log")])
    resumed = SUMMARY.fullmatch(out.splitlines()[-1])
    assert code == 0 and resumed, out[-2000:]
    assert resumed.group(1, 2, 3, 8, 9) == ("4", "10", "7", "10", str(tmp_path / "resumed.log"))
    assert (tmp_path / "resumed.log").read_text().splitlines()[-1] == resumed.group(0)
