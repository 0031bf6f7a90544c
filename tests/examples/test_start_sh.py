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
    params = r"(?:[\d.]+[MB]\s+)?"  # the table's parameter column, where it has one
    assert re.search(rf"^\s*55\s+{params}68\s+8192\s+64\s+32768\s+10$", proc.stdout, re.M)
    assert re.search(rf"^\s*28\s+{params}26\s+8192\s+128\s+32768\s+38$", proc.stdout, re.M)


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
    logs = list((tmp_path / "ckpt" / "logs").glob("start-*.log"))  # SAVE_DIR/logs: the whole output, kept
    assert len(logs) == 1 and "validation loss at iteration 4" in logs[0].read_text()
    assert proc.stdout.rstrip().endswith(f"[start.sh] log of this run (all of the above): {logs[0]}")
    (train_log,) = (tmp_path / "ckpt" / "logs").glob("train-*.log")  # the trainer's own, named in its summary
    block = proc.stdout.splitlines()[-4:-1]
    assert re.fullmatch(r"\[start.sh\] iterations 1-4 \(4 this run\), final lm loss [0-9.]+E\+00, tokens/s [0-9.]+, "
                        r"elapsed 0:\d\d:\d\d", block[0]), block
    assert block[1:] == [f"[start.sh] checkpoint: {tmp_path / 'ckpt'} at iteration 4; the same SAVE_DIR resumes from "
                         "it (a larger TRAIN_ITERS trains on)", f"[start.sh] trainer's log: {train_log}"]
    proc = _run(env={**env, "TRAIN_ITERS": "6"})  # resumes at 4
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[start.sh] reusing the memory plan in {tmp_path / 'ckpt' / 'plan'}" in proc.stdout
    assert "starting at iteration 4" in proc.stdout
    assert re.search(r"iteration\s+6/\s+6", proc.stdout)


def test_a_bad_flag_is_the_trainers_one_line_and_exit_code(tmp_path):
    """Bad input reaches the user as the trainer's line and exit code 2, not as the launcher's report."""
    proc = _run(env={"TRAIN_ITERS": "2", "SEQ_LEN": "64", "EXTRA_ARGS": "--clip-grad -1", "LOG_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr  # the launcher passes the ranks' lines through on stdout
    errors = [ln for ln in out.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "--clip-grad must be >= 0" in errors[0], out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out


def test_size_that_cannot_fit_is_refused_before_anything_starts(tmp_path):
    """start.sh 55 on a 24 GiB CPU node (given explicitly, so the test does not depend on this machine)."""
    import time

    t0 = time.monotonic()
    proc = _run("55", env={"NPROC": "2", "PLAN_ARGS": "--host-memory-gib 24 --nvme-free-gib 70",
                           "LOG_DIR": str(tmp_path)}, timeout=300)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^does not fit: 55 GPT 54\.\d\dB parameters \(68 layers", proc.stdout, re.M)
    assert re.search(r"the largest examples/start.sh size that fits: \S+", proc.stdout)
    assert "the requested model needs (states on SSD)" in proc.stdout
    assert "[start.sh] size 55 cannot be trained here (memory planner exit 3); nothing was started" in proc.stdout
    assert "[start.sh] size=" not in proc.stdout and "> model:" not in proc.stdout  # no training was launched
    assert time.monotonic() - t0 < 120


@pytest.fixture(scope="module")
def stand_in_venv(tmp_path_factory) -> Path:
    """A venv whose ``ptm-launch`` writes its arguments, one a line, to $LAUNCHED instead of starting ranks, then
    prints $LAUNCH_OUTPUT and exits with $LAUNCH_RC (default 0): the table, the plan, the flags and the closing
    summary are start.sh's own, nothing trains. Its ``python`` is this test's interpreter, with a ``pip`` that
    installs nothing, so the set-up (bootstrap.sh) only stamps the venv, once for the module."""
    import sys

    venv = tmp_path_factory.mktemp("venv")
    (venv / "bin").mkdir()
    scripts = {"python": f'[ "$1 $2" = "-m pip" ] && exit 0\nexec "{sys.executable}" "$@"\n',
               "ptm-launch": 'for a in "$@"; do printf "%s\\n" "$a"; done > "$LAUNCHED"\n'
                             '[ -z "${LAUNCH_OUTPUT:-}" ] || printf "%s\\n" "$LAUNCH_OUTPUT"\n'
                             'exit "${LAUNCH_RC:-0}"\n'}
    for name, body in scripts.items():
        path = venv / "bin" / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    return venv


def _recording_venv(tmp_path: Path, venv: Path) -> dict[str, str]:
    """start.sh's environment with the stand-in venv, a DATA_PATH whose tokenizer is a GPT-2 BPE of 300 ids, and
    SAVE_DIR under tmp_path."""
    import json

    for name in ("corpus.bin", "corpus.idx"):  # what the trainer's parser checks exists
        (tmp_path / name).write_text("")
    (tmp_path / "vocab.json").write_text(json.dumps({**{f"t{i}": i for i in range(299)}, "<|endoftext|>": 299}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return {"PTM_VENV": str(venv), "LAUNCHED": str(tmp_path / "launched.txt"), "DATA_PATH": str(tmp_path / "corpus"),
            "VOCAB_FILE": str(tmp_path / "vocab.json"), "MERGE_FILE": str(tmp_path / "merges.txt"),
            "PLAN_ARGS": "--host-memory-gib 24 --nvme-free-gib 70", "SAVE_DIR": str(tmp_path / "ckpt")}


def _flag(words: list[str], flag: str) -> str:
    return words[len(words) - 1 - words[::-1].index(flag) + 1]  # the last occurrence wins, as in argparse


def test_moe_size_plans_and_passes_the_experts_to_the_trainer(tmp_path, stand_in_venv):
    """start.sh moe-tiny with EP=2 on 4 processes: the planner plans the mixture of experts with expert
    parallelism, and the trainer gets the size's MoE flags, EP and the plan's config, flags its parser takes."""
    from megatron.training.arguments import parse_args

    env = _recording_venv(tmp_path, stand_in_venv)
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


def test_long_context_size_splits_its_sequences_over_cp_ranks(tmp_path, stand_in_venv):
    """start.sh 1.3b-32k with CP=2 (its sequence shortened by SEQ_LEN to plan on this machine): the planner plans
    the context-parallel layout, and the trainer gets RoPE, no attention dropout and the CP flags."""
    from megatron.training.arguments import parse_args

    env = _recording_venv(tmp_path, stand_in_venv)
    proc = _run("1.3b-32k", env={**env, "CP": "2", "SEQ_LEN": "4096", "TRAIN_ITERS": "3"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\[start.sh\] size=1.3b-32k .* TP=1 PP=1 EP=1 CP=2 DP=1 .*seq=4096", proc.stdout, re.M), \
        proc.stdout
    args = Path(env["LAUNCHED"]).read_text().splitlines()[3:]
    assert [_flag(args, f) for f in ("--context-parallel-size", "--seq-length", "--position-embedding-type",
                                     "--attention-dropout")] == ["2", "4096", "rope", "0"]
    cfg = parse_args(args, world_size=2)
    assert (cfg.parallel.context_parallel_size, cfg.parallel.data_parallel_size) == (2, 1)



def test_context_parallel_ring_attention_trains_without_attention_dropout(tmp_path, stand_in_venv):
    """CP=2 on the default size (whose dropout is the trainer's 0.1): ring attention takes none, so start.sh sets
    --attention-dropout 0 for the planner and the trainer itself, in one line, and the trainer takes the flags."""
    from megatron.training.arguments import parse_args

    env = _recording_venv(tmp_path, stand_in_venv)
    proc = _run(env={**env, "NPROC": "2", "CP": "2", "SEQ_LEN": "1024", "TRAIN_ITERS": "3"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("[start.sh] CP=2 with p2p attention, which takes no attention dropout: training with --attention-dropout 0 "
            "(CP_COMM_TYPE=a2a keeps it)") in proc.stdout.splitlines()
    assert re.search(r"^\[start.sh\] fits: default GPT .* \(TP 1, CP 2, PP 1, DP 1\)", proc.stdout, re.M), proc.stdout
    args = Path(env["LAUNCHED"]).read_text().splitlines()[3:]
    assert [_flag(args, f) for f in ("--context-parallel-size", "--cp-comm-type", "--attention-dropout")] == \
        ["2", "p2p", "0"]
    cfg = parse_args(args, world_size=2)
    assert (cfg.parallel.context_parallel_size, cfg.model.attention_dropout) == (2, 0.0)


def _plan_kept(env: dict[str, str]) -> None:
    """A memory plan already in SAVE_DIR/plan: start.sh reuses it instead of running the planner (the default size
    takes only its presence from it)."""
    plan = Path(env["SAVE_DIR"]) / "plan"
    plan.mkdir(parents=True)
    (plan / "model_args.txt").write_text("")
    (plan / "ds_config.json").write_text("{}")


SUMMARY_LINE = ("run summary: iterations 0-3 (3 this run) | final lm loss 7.123456E+00 | tokens/s 1234.5 | "
                "elapsed 0:00:09 | {ckpt} | {log}")


def test_run_ends_with_a_summary_and_keeps_its_output_in_a_log(tmp_path, stand_in_venv):
    """The trainer's run summary line, read back: what ran, the result, the checkpoint (or how to get one), the
    trainer's log, and start.sh's own log of the whole run."""
    env = _recording_venv(tmp_path, stand_in_venv)
    _plan_kept(env)
    ckpt = env["SAVE_DIR"]
    line = SUMMARY_LINE.format(ckpt=f"checkpoint {ckpt} at iteration 3", log=f"log {ckpt}/train.log")
    proc = _run(env={**env, "NPROC": "2", "TRAIN_ITERS": "3", "LAUNCH_OUTPUT": f"[rank1]: {line}"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = list((tmp_path / "ckpt" / "logs").glob("start-*.log"))  # SAVE_DIR/logs by default
    assert len(logs) == 1
    block = proc.stdout[proc.stdout.index("[start.sh] ---- summary ----"):].splitlines()
    assert block == [
        "[start.sh] ---- summary ----",
        "[start.sh] ran: size default on 2 processes (TP=1 PP=1 EP=1 CP=1 DP=2), Megatron DDP",
        "[start.sh] iterations 0-3 (3 this run), final lm loss 7.123456E+00, tokens/s 1234.5, elapsed 0:00:09",
        f"[start.sh] checkpoint: {ckpt} at iteration 3; the same SAVE_DIR resumes from it (a larger TRAIN_ITERS "
        "trains on)",
        f"[start.sh] trainer's log: {ckpt}/train.log",
        f"[start.sh] log of this run (all of the above): {logs[0]}"]
    assert logs[0].read_text() == proc.stdout  # the whole output, the summary included

    # Nothing saved: the block says how to save and resume; LOG_DIR puts the log elsewhere.
    env.pop("SAVE_DIR")
    line = SUMMARY_LINE.format(ckpt="not saved: --save not set", log="log stdout only")
    proc = _run(env={**env, "NPROC": "2", "TRAIN_ITERS": "3", "LAUNCH_OUTPUT": line, "TMPDIR": str(tmp_path),
                     "LOG_DIR": str(tmp_path / "logs")}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (log,) = (tmp_path / "logs").glob("start-*.log")
    assert proc.stdout.splitlines()[-3:] == [
        "[start.sh] iterations 0-3 (3 this run), final lm loss 7.123456E+00, tokens/s 1234.5, elapsed 0:00:09",
        "[start.sh] nothing was saved: SAVE_DIR is not set; SAVE_DIR=checkpoints/default bash examples/start.sh "
        "default saves every SAVE_INTERVAL (100) iterations there and resumes from it when run again",
        f"[start.sh] log of this run (all of the above): {log}"]


def test_a_failed_run_says_so_and_points_at_its_log(tmp_path, stand_in_venv):
    env = _recording_venv(tmp_path, stand_in_venv)
    _plan_kept(env)
    proc = _run(env={**env, "NPROC": "2", "LAUNCH_OUTPUT": "pretrain_gpt.py: error: something broke",
                     "LAUNCH_RC": "1"}, timeout=300)
    assert proc.returncode == 1
    (log,) = (tmp_path / "ckpt" / "logs").glob("start-*.log")
    assert proc.stdout.splitlines()[-2:] == [
        "[start.sh] the run failed (exit 1) before its summary: the cause is the error line above; the whole output "
        "is in the log below",
        f"[start.sh] log of this run (all of the above): {log}"]
    assert "pretrain_gpt.py: error: something broke" in log.read_text()


@pytest.mark.parametrize("env, line", [
    ({"NPROC": "2", "TP": "3"}, "TP=3 does not divide NPROC=2: every data-parallel replica takes TP x PP x CP "
                                "processes; set NPROC to a multiple of 3 or change TP, PP, CP"),
    ({"NPROC": "6", "TP": "2", "PP": "2"}, "TP=2 x PP=2 = 4 does not divide NPROC=6: every data-parallel replica "
                                           "takes TP x PP x CP processes; set NPROC to a multiple of 4 or change TP, "
                                           "PP, CP"),
    ({"NPROC": "2", "EP": "2"}, "EP=2 splits the experts of a mixture of experts, and size default has none; use a "
                                "moe-* size (bash examples/start.sh list) or EP=1"),
    ({"NPROC": "2", "CP": "2", "SEQ_LEN": "130"}, "SEQ_LEN=130 is not a multiple of 4: every sequence is cut into 2 x "
                                                  "CP pieces (with CP > 1), each into TP (with TP > 1); use a multiple "
                                                  "of 4"),
    ({"NPROC": "2", "VOCAB_FILE": "missing.json"}, "VOCAB_FILE={tmp}/missing.json does not exist; give the vocab.json "
                                                   "of DATA_PATH's tokenizer (or TOKENIZER_ARGS for another kind of "
                                                   "tokenizer)"),
    ({"NPROC": "2", "PLAN_ARGS": "--host-memory-gib -1"},
     "the memory planner refused size default with these settings (PLAN_ARGS passes it flags): --host-memory-gib must "
     "be >= 0; nothing was started"),
])
def test_bad_settings_are_one_line_naming_the_variable(tmp_path, stand_in_venv, env, line):
    """Refused before anything starts, in the names the user set (the planner's reason where only it knows)."""
    base = _recording_venv(tmp_path, stand_in_venv)
    proc = subprocess.run(["bash", str(ROOT / "examples" / "start.sh")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **base, **env})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[start.sh] error: " + line.format(tmp=tmp_path)
    assert not Path(base["LAUNCHED"]).exists()


def test_plan_is_of_the_users_tokenizer_and_says_it_is_not_of_ds_config(tmp_path, stand_in_venv):
    """DATA_PATH's tokenizer has 300 ids: the plan's model has its vocabulary (padded to 384), not GPT-2's; and
    with DS_CONFIG the fits line says the plan is not of that config."""
    env = _recording_venv(tmp_path, stand_in_venv)
    ds = tmp_path / "ds.json"
    ds.write_text((ROOT / "examples" / "ds_config_zero3.json").read_text())
    proc = _run(env={**env, "NPROC": "2", "DS_CONFIG": str(ds)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (fits,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("[start.sh] fits: ")]
    assert re.search(r"fits: default GPT 4\.\d+M parameters \(6 layers, hidden 256, 8 heads, ffn 1024, seq 256, "
                     r"vocab 384, fp32\)", fits), fits
    assert fits.endswith(f"; planned with the planner's zero_cache config, not DS_CONFIG={ds}, whose memory is not "
                         "checked)")
    args = Path(env["LAUNCHED"]).read_text().splitlines()
    assert _flag(args, "--deepspeed_config") == str(ds)


def test_min_nodes_checks_every_smaller_mesh_and_passes_the_elastic_range(tmp_path, stand_in_venv):
    """MIN_NODES: each node count down to it must still split into the mesh; then ptm-launch gets --nnodes."""
    base = _recording_venv(tmp_path, stand_in_venv)
    (tmp_path / "hostfile").write_text("10.0.0.1 slots=2\n10.0.0.2 slots=2\n")
    env = {**os.environ, **base, "HOSTFILE": "hostfile", "MAX_RESTARTS": "1", "MIN_NODES": "1", "MBS": "1",
           "GBS": "8"}

    def start(**extra):
        return subprocess.run(["bash", str(ROOT / "examples" / "start.sh")], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env={**env, **extra})
    refused = start(TP="2", PP="2")
    assert refused.returncode == 2 and not Path(base["LAUNCHED"]).exists(), refused.stdout[-3000:]
    assert refused.stdout.splitlines()[-1] == (
        "[start.sh] error: MIN_NODES=1: on 1 of the 2 hosts (2 processes) TP x PP x CP = 4, EP=1 and GBS=8 (MBS=1) "
        "do not divide the data-parallel ranks that remain; raise MIN_NODES or choose sizes that divide")
    started = start(TP="2")
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    launched = Path(base["LAUNCHED"]).read_text().splitlines()
    assert launched[:6] == ["--hostfile", str(tmp_path / "hostfile"), "--max_restarts", "1", "--nnodes", "1:2"]
