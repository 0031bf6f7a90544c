"""The pure parts of benchmarks/cluster/zero3_layouts.py and the harness-line parser of benchmarks/cluster/job.py:
no root, no hosts, no processes."""
from __future__ import annotations

import math

import pytest

from benchmarks.cluster import zero3_layouts as zl
from benchmarks.cluster.counters import HostBytes, LinkBytes
from benchmarks.cluster.job import JobResult, Step, Summary, parse_step, summarize
from benchmarks.peer_workers.harness import BenchSpec

MIB = 2**20


def test_harness_step_lines_count_as_steps_and_trainer_lines_still_do():
    step = parse_step("[ours-zero++] step 3/6: loss 4.765132, 0.22 s, 9102.0 tokens/s, ETA 1 s")
    assert (step.iteration, step.seconds, step.loss) == (3, 0.22, 4.765132)
    assert math.isnan(parse_step("[ddp] step 1/6: loss nan, 1.50 s, 10.0 tokens/s, ETA 8 s").loss)
    trainer = parse_step(" iteration        2/       4 | consumed samples: 32 | elapsed time per iteration (ms): "
                         "361.5 | learning rate: 1.0E-03 |")
    assert (trainer.iteration, trainer.seconds, trainer.loss) == (2, 0.3615, None)
    assert parse_step("[ours-flat] profiled 1 step(s): copies 0") is None
    assert parse_step("step 3/6: loss 4.7, 0.22 s") is None


def _links(inter: int, intra: int) -> LinkBytes:
    return LinkBytes((HostBytes(inter, 0, intra, 0),))


def test_summary_skips_the_warmup_steps():
    steps = [Step(1, 9.0, _links(900, 90)), Step(2, 8.0, _links(800, 80)), Step(3, 1.0, _links(100, 10)),
             Step(4, 3.0, _links(300, 30)), Step(5, 2.0, _links(200, 20))]
    s = summarize(JobResult(0, None, [], steps, _links(0, 0)), skip=2)
    assert (s.steps, s.seconds, s.inter_bytes, s.intra_bytes) == (3, 2.0, 200, 20)


def test_layout_keys_and_the_hsdp_spec_field():
    assert zl.zero_keys("mics", 4) == {**zl.BASE_ZERO_KEYS, "mics_shard_size": 4}
    assert zl.zero_keys("zero++", 2) == {**zl.BASE_ZERO_KEYS, "zero_hpz_partition_size": 2,
                                         "zero_quantized_weights": True, "zero_quantized_gradients": True}
    assert zl.zero_keys("mics+qw", 2) == {**zl.BASE_ZERO_KEYS, "mics_shard_size": 2, "zero_quantized_weights": True}
    base = BenchSpec(layers=2, hidden=32, heads=2, vocab=128, seq=16, micro_batch=1, global_batch=4, steps=1,
                     warmup=1, lr=1e-3, weight_decay=0.0, clip_grad=1.0, seed=1, page_size=64, threads=1)
    assert zl.job_spec(base, zl.BY_NAME["fsdp2-hsdp"], 2).hsdp_shard_size == 2
    assert zl.job_spec(base, zl.BY_NAME["fsdp2"], 2).hsdp_shard_size == 0


def test_bf16_equivalent_halves_exact_bytes_only():
    assert zl.bf16_inter_bytes(1000.0, "flat") == 500.0
    assert zl.bf16_inter_bytes(1000.0, "mics+qw") == 500.0  # its int8 gathers stay inside the host
    assert zl.bf16_inter_bytes(1000.0, "zero++") == 1000.0
    # (q_w + G q_g) / (3 G e): one micro-batch in bf16 is 1.53 / 6; four micro-batches in fp32 (1.016 + 2.062) / 48
    q_w, q_g = 1 + 4 / 256, 0.5 + 4 / 256
    assert zl.zeropp_expected_ratio(1) == pytest.approx((q_w + q_g) / 6)
    assert zl.zeropp_expected_ratio(4, bf16=False) == pytest.approx((q_w + 4 * q_g) / 48)
    assert zl.zeropp_expected_ratio(1, grad_bits=8) == pytest.approx((q_w + 1 + 4 / 256) / 6)


def _ok(name: str, seconds: float, inter_mib: float, losses: list[float]) -> zl.Outcome:
    return zl.Outcome(zl.BY_NAME[name], Summary(4, seconds, inter_mib * MIB, MIB, None), losses)


def test_table_rows_ratios_against_both_flats_and_failures_in_their_row():
    outcomes = [_ok("ours-flat", 1.0, 1.0, [5.0, 4.0]), _ok("ours-zero++", 0.5, 0.1, [5.0, 4.04]),
                _ok("deepspeed-flat", 2.0, 0.8, [5.0, 4.0]),
                zl.Outcome(zl.BY_NAME["deepspeed-zero++"], None, [], "ValueError: not on CPU"),
                _ok("fsdp2-hsdp", 1.0, 0.5, [5.0, 4.0])]
    rows = zl.table_rows("2x2", "h100", outcomes, tokens_per_step=1000)
    assert len(rows) == 5 and all(r.count("|") == zl.HEADER[0].count("|") for r in rows)
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    flat, zpp, ds, failed, hsdp = cells
    # s/step, tokens/s, vs deepspeed-flat, vs ours-flat
    assert flat[3:7] == ["1.00", "1000", "2.00", "1.00"]
    assert zpp[3:7] == ["0.50", "2000", "4.00", "2.00"]
    assert ds[5:7] == ["1.00", "0.50"]
    # inter-host vs flat: measured, then bf16-equivalent (ZeRO++ int8 keeps its bytes, flat halves)
    assert zpp[9:11] == ["0.100", "0.200"]
    assert flat[9:11] == ["1.000", "1.000"]
    assert zpp[11:] == ["4.040000", "1.0e-02"]
    assert failed[3] == "failed: ValueError: not on CPU"
    assert hsdp[9:11] == ["-", "-"]  # its reference, fsdp2, did not run


def test_a_failed_job_reports_the_ranks_error_line(tmp_path):
    (tmp_path / "error_rank1.txt").write_text("DeepSpeedConfigError: MiCS | removed\nTraceback ...\n")
    result = JobResult(1, "host 1 (10.78.0.1) exited with code 1; its last lines:\n  ...", [], [], _links(0, 0))
    got = zl.outcome(zl.BY_NAME["deepspeed-mics"], result, tmp_path, warmup=2)
    assert got.error == "DeepSpeedConfigError: MiCS / removed" and got.summary is None
    (tmp_path / "error_rank1.txt").unlink()
    assert zl.outcome(zl.BY_NAME["ddp"], result, tmp_path, warmup=2).error == \
        "host 1 (10.78.0.1) exited with code 1; its last lines:"
