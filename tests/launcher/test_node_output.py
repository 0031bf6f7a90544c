"""What the launcher shows of a node's output and the events it reads from it, on torchrun's real output.

data/torchrun_restart_then_fail.log is torch 2.13's torchrun (LOGLEVEL=INFO, --max-restarts 1) running
standin_train.py with rank 1 raising at step 1, twice: the agent log, the restart, both rendezvous rounds,
rank 0's "Connection closed by peer" traceback, and torchrun's ChildFailedError traceback and summary box.
"""
from __future__ import annotations

from pathlib import Path

from ptm_launch.node_output import CauseLine, NodeOutput, RestartRequested, RoundComplete, WorkerFailed

LOG = (Path(__file__).parent / "data" / "torchrun_restart_then_fail.log").read_text(encoding="utf-8").splitlines()


def _run(lines):
    out = NodeOutput()
    shown = []
    for i, line in enumerate(lines):
        shown += out.feed(line, now=float(i))
    return out, shown + out.flush(now=float(len(lines)))


def test_torchrun_log_becomes_events_and_only_the_ranks_output_is_shown():
    out, shown = _run(LOG)
    events = out.events
    failures = [e for e in events if isinstance(e, WorkerFailed)]
    assert [(f.local_rank, f.exitcode) for f in failures] == [(1, 1), (1, 1)]
    assert [e.membership for e in events if isinstance(e, RestartRequested)] == [False]
    assert [(e.restart_count, e.global_ranks) for e in events if isinstance(e, RoundComplete)] == \
        [(0, (0, 1)), (1, (0, 1))]
    causes = [e for e in events if isinstance(e, CauseLine)]
    assert [(c.text, c.rank) for c in causes] == [("RuntimeError: injected failure on rank 1 at step 1", 1)] * 2
    # event order: each failure comes before the restart (or the end) it leads to
    kinds = [type(e).__name__ for e in events if not isinstance(e, CauseLine)]
    assert kinds == ["RoundComplete", "WorkerFailed", "RestartRequested", "RoundComplete", "WorkerFailed"]

    text = "\n".join(shown)
    assert not any(line[:1] in "IWE" and "torch/distributed/elastic" in line for line in shown)  # agent log
    assert "ChildFailedError" not in text and "Root Cause" not in text and "=====" not in text  # torchrun's box
    assert "Connection closed by peer" not in text  # rank 0 only stopped because rank 1 failed
    assert text.count("[rank1]: RuntimeError: injected failure on rank 1 at step 1") == 2  # the cause, as printed
    assert text.count("[rank1]: Traceback (most recent call last):") == 2
    assert [line for line in shown if line.startswith("step ")] == ["step 0 loss 1.54244299e+01",
                                                                    "step 1 loss 2.75502825e+00"] * 2
    assert len(out.secondary) == 2 and "Connection closed by peer" in out.secondary[0][1]


def test_one_line_errors_of_the_trainer():
    out, shown = _run([
        "pretrain_gpt.py: error: the train split of data/x_text_document has no documents; use more data",
        "rank 1: stopping: another rank failed (RuntimeError)",
        "[rank2]: rank 2: stopping: another rank failed (DistNetworkError)",
        "iteration 3 done",
    ])
    assert shown == ["pretrain_gpt.py: error: the train split of data/x_text_document has no documents; use more data",
                     "iteration 3 done"]
    assert [c.text for c in out.events] == [shown[0]]
    assert [line for _, line in out.secondary] == ["rank 1: stopping: another rank failed (RuntimeError)",
                                                   "rank 2: stopping: another rank failed (DistNetworkError)"]


def test_a_rank_that_names_silent_ranks_states_the_cause():
    silent = ("rank 0: stopping: rank 1 stopped answering (RuntimeError: all_reduce at zero_cache/comm.py:173 timed "
              "out; no heartbeat from it for 5 s)")
    two = "rank 2: stopping: ranks 1, 3 stopped answering (RuntimeError: wait timed out)"
    out, shown = _run([silent, f"[rank2]: {two}"])
    assert shown == [silent, f"[rank2]: {two}"]
    assert [(c.text, c.rank) for c in out.events] == [(silent, None), (two, 2)]
    assert out.secondary == []


def test_other_agent_warnings_and_unprefixed_tracebacks_are_kept():
    lines = [
        "W1201 11:01:57.136000 31087 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1 The node "
        "'x' has failed to send a keep-alive heartbeat",
        "Traceback (most recent call last):",
        '  File "train.py", line 3, in <module>',
        "    import missing_module",
        "ModuleNotFoundError: No module named 'missing_module'",
    ]
    out, shown = _run(lines)
    assert shown == lines  # a warning the launcher does not report itself, and a rank's own traceback
    assert [c.text for c in out.events if isinstance(c, CauseLine)] == ["ModuleNotFoundError: No module named "
                                                                        "'missing_module'"]


def test_a_traceback_cut_off_by_the_end_of_the_stream_is_shown():
    out, shown = _run(["[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 1'])
    assert shown == ["[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 1']
