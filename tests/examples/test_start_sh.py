"""examples/start.sh, the README's main command: sizes table, and a short real run on the sample corpus."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from ptm_planner.sizes import table

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, env=None, timeout=600):
    return subprocess.run(["bash", "examples/start.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_list_prints_the_sizes_table():
    proc = _run("list")
    assert (proc.returncode, proc.stdout) == (0, table() + "\n"), proc.stderr


def test_unknown_size_prints_the_table():
    proc = _run("bogus")
    assert proc.returncode == 2
    assert "unknown SIZE 'bogus'" in proc.stdout
    for size in ("default", "125m", "1.3b", "28 ", "55 "):
        assert size in proc.stdout
    assert re.search(r"^\s*55\s+68\s+8192\s+64\s+32768\s+10$", proc.stdout, re.M)
    assert re.search(r"^\s*28\s+26\s+8192\s+128\s+32768\s+38$", proc.stdout, re.M)


def test_default_run_trains_on_the_sample_corpus(tmp_path):
    """Corpus -> tokenizer -> preprocess -> 2-process training, then resume from its checkpoint."""
    env = {"TRAIN_ITERS": "4", "SEQ_LEN": "64", "MBS": "2", "LOG_INTERVAL": "2", "EVAL_INTERVAL": "4",
           "EVAL_ITERS": "1", "SAVE_DIR": str(tmp_path / "ckpt"), "SAVE_INTERVAL": "2"}
    proc = _run(env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\[start.sh\] fits: default GPT", proc.stdout, re.M)  # the memory planner was consulted
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", proc.stdout)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert "validation loss at iteration 4" in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ROOT / "data" / "sample" / "corpus_text_document.idx").is_file()
    proc = _run(env={**env, "TRAIN_ITERS": "6"})  # resumes at 4
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[start.sh] reusing the memory plan in {tmp_path / 'ckpt' / 'plan'}" in proc.stdout
    assert "starting at iteration 4" in proc.stdout
    assert re.search(r"iteration\s+6/\s+6", proc.stdout)


def test_a_bad_flag_is_the_trainers_one_line_and_exit_code(tmp_path):
    """Bad input reaches the user as the trainer's line and exit code 2, not as the launcher's report."""
    proc = _run(env={"TRAIN_ITERS": "2", "SEQ_LEN": "64", "EXTRA_ARGS": "--clip-grad -1"})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr  # the launcher passes the ranks' lines through on stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "--clip-grad must be >= 0" in errors[0], out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out


def test_size_that_cannot_fit_is_refused_before_anything_starts():
    """start.sh 55 on a 24 GiB CPU node (given explicitly, so the test does not depend on this machine)."""
    import time

    t0 = time.monotonic()
    proc = _run("55", env={"NPROC": "2", "PLAN_ARGS": "--host-memory-gib 24 --nvme-free-gib 70"}, timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^does not fit: 55 GPT 54\.\d\dB parameters \(68 layers", proc.stdout, re.M)
    assert re.search(r"the largest examples/start.sh size that fits: \S+", proc.stdout)
    assert "the requested model needs (states on SSD)" in proc.stdout
    assert "[start.sh] size 55 cannot be trained here (memory planner exit 3); nothing was started" in proc.stdout
    assert "[start.sh] size=" not in proc.stdout and "> model:" not in proc.stdout  # no training was launched
    assert time.monotonic() - t0 < 120


def _recording_venv(tmp_path: Path) -> dict[str, str]:
    """start.sh's environment with a venv whose ``ptm-launch`` writes its arguments, one a line, to $LAUNCHED
    instead of starting ranks: the table, the plan and the flags are start.sh's own, nothing trains. Its
    ``python`` is this test's interpreter and refuses pip, so the set-up (bootstrap.sh, which finds this venv's
    stamp) cannot install anything."""
    import sys

    stamps = [Path(sys.prefix) / name for name in (".ptm-installed", ".ptm-installed-dev")]
    stamp = next((p for p in stamps if p.is_file()), None)
    if stamp is None:
        pytest.skip(f"{sys.prefix} was not set up by scripts/bootstrap.sh (no stamp)")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in (".ptm-installed", ".ptm-installed-dev"):  # the same hash either way
        (venv / name).write_text(stamp.read_text())
    scripts = {"python": f'[ "$1 $2" = "-m pip" ] && {{ echo "no installs in this test" >&2; exit 1; }}\n'
                         f'exec "{sys.executable}" "$@"\n',
               "ptm-launch": 'for a in "$@"; do printf "%s\\n" "$a"; done > "$LAUNCHED"\n'}
    for name, body in scripts.items():
        path = venv / "bin" / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    for name in ("corpus.bin", "corpus.idx", "vocab.json", "merges.txt"):  # what the trainer's parser checks exists
        (tmp_path / name).write_text("")
    return {"PTM_VENV": str(venv), "LAUNCHED": str(tmp_path / "launched.txt"), "DATA_PATH": str(tmp_path / "corpus"),
            "VOCAB_FILE": str(tmp_path / "vocab.json"), "MERGE_FILE": str(tmp_path / "merges.txt"),
            "PLAN_ARGS": "--host-memory-gib 24 --nvme-free-gib 70", "SAVE_DIR": str(tmp_path / "ckpt")}


def _flag(words: list[str], flag: str) -> str:
    return words[len(words) - 1 - words[::-1].index(flag) + 1]  # the last occurrence wins, as in argparse


def test_moe_size_plans_and_passes_the_experts_to_the_trainer(tmp_path):
    """start.sh moe-tiny with EP=2 on 4 processes: the planner plans the mixture of experts with expert
    parallelism, and the trainer gets the size's MoE flags, EP and the plan's config, flags its parser takes."""
    from megatron.training.arguments import parse_args

    env = _recording_venv(tmp_path)
    proc = _run("moe-tiny", env={**env, "NPROC": "4", "EP": "2", "TRAIN_ITERS": "3"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = (tmp_path / "ckpt" / "plan" / "plan.txt").read_text()
    assert re.search(r"^fits: moe-tiny GPT [\d.]+M parameters, [\d.]+M active \(4 layers, hidden 256, 8 heads, "
                     r"ffn 1024, 4 experts top-2 of ffn 512,", plan, re.M), plan
    assert "4 experts per MoE layer, 2 on each rank (EP 2), their states sharded over 2 rank(s) (DP 4 / EP 2)" in plan
    assert re.search(r"^\[start.sh\] size=moe-tiny .*moe: --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size "
                     r"512 --moe-aux-loss-coeff 1e-2 nproc=4 TP=1 PP=1 EP=2 CP=1 DP=4", proc.stdout, re.M), proc.stdout
    words = Path(env["LAUNCHED"]).read_text().splitlines()
    assert words[:3] == ["--num_gpus", "4", "pretrain_gpt.py"]
    args = words[3:]
    assert [_flag(args, f) for f in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                                     "--expert-model-parallel-size", "--num-layers")] == ["4", "2", "512", "2", "4"]
    assert _flag(args, "--deepspeed_config") == str(tmp_path / "ckpt" / "plan" / "ds_config.json")
    cfg = parse_args(args, world_size=4)
    assert cfg.parallel.expert_model_parallel_size == 2
    moe = cfg.model.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size) == (4, 2, 512)


def test_long_context_size_splits_its_sequences_over_cp_ranks(tmp_path):
    """start.sh 1.3b-32k with CP=2 (its sequence shortened by SEQ_LEN to plan on this machine): the planner plans
    the context-parallel layout, and the trainer gets RoPE, no attention dropout and the CP flags."""
    from megatron.training.arguments import parse_args

    env = _recording_venv(tmp_path)
    proc = _run("1.3b-32k", env={**env, "CP": "2", "SEQ_LEN": "4096", "TRAIN_ITERS": "3"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\[start.sh\] size=1.3b-32k .* TP=1 PP=1 EP=1 CP=2 DP=1 .*seq=4096", proc.stdout, re.M), \
        proc.stdout
    args = Path(env["LAUNCHED"]).read_text().splitlines()[3:]
    assert [_flag(args, f) for f in ("--context-parallel-size", "--seq-length", "--position-embedding-type",
                                     "--attention-dropout")] == ["2", "4096", "rope", "0"]
    cfg = parse_args(args, world_size=2)
    assert (cfg.parallel.context_parallel_size, cfg.parallel.data_parallel_size) == (2, 1)


def test_expert_parallelism_of_a_dense_size_is_refused_by_the_plan(tmp_path):
    env = _recording_venv(tmp_path)
    proc = _run("default", env={**env, "EP": "2"}, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plan_memory.py: error: --expert-model-parallel-size 2 splits experts; give --num-experts" in proc.stderr
    assert "[start.sh] size default cannot be trained here (memory planner exit 2); nothing was started" in proc.stdout
    assert not Path(env["LAUNCHED"]).exists()
