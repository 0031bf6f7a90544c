"""The global batch size over consumed samples: Megatron's ramp-up and step-schedule formulas, the training
length they give, and the checks that fail at start-up rather than hours into a run."""
import pytest

from megatron.training.arguments import ConfigError, parse_args
from megatron.training.batch_schedule import BatchSchedule, parse_step_schedule
from tests.training.parallel_harness import TINY_GPT


def _megatron_rampup(consumed, start, increment, samples, final):
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, as written there."""
    if consumed > samples:
        return final
    per_increment = samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def test_rampup_follows_megatrons_formula():
    ramp = BatchSchedule(1536, rampup=(16, 16, 5_859_375))
    for consumed in (0, 1, 61_034, 61_035, 3_000_000, 5_859_375, 5_859_376, 10 ** 9):
        assert ramp.global_batch_size(consumed) == _megatron_rampup(consumed, 16, 16, 5_859_375, 1536), consumed
    assert ramp.sizes() == list(range(16, 1537, 16))
    small = BatchSchedule(8, rampup=(4, 4, 8))
    assert [small.global_batch_size(c) for c in (0, 4, 8, 9)] == [4, 4, 8, 8]
    assert small.samples_after(3) == 16 and small.samples_after(5) == 32
    assert small.iterations_for(16) == 3 and small.iterations_for(17) == 4  # until reached, as Megatron-LM


def test_step_schedule_thresholds_are_tokens():
    steps = parse_step_schedule("0:16 2.4B:320 4.8B:624", seq_length=2048)
    assert steps == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    schedule = BatchSchedule(624, steps=steps)
    assert [schedule.global_batch_size(c) for c in (0, steps[1][0] - 1, steps[1][0], 10 ** 9)] == [16, 16, 320, 624]
    for text, message in (("16", "is not THRESHOLD:BATCH_SIZE"), ("0:16 1x:32", "'1x' is not a number"),
                          ("0:0", "batch sizes must be > 0"), ("", "is empty")):
        with pytest.raises(ValueError, match=message):
            parse_step_schedule(text, 16)
    with pytest.raises(ValueError, match="the first entry must start at 0"):
        BatchSchedule(32, steps=((16, 16), (32, 32)))


def test_constant_batches_count_whole_batches():
    constant = BatchSchedule(8)
    assert constant.constant and constant.iterations_for(20) == 2
    assert constant.iterations_for(20, until_reached=True) == 3


@pytest.mark.parametrize("extra, message", [
    (["--rampup-batch-size", "2", "4", "8"], "must be start \\+ a multiple of the increment"),
    (["--rampup-batch-size", "2", "2", "8"], "reaches global batch size 2, not divisible by --micro-batch-size 2 x "
                                             "data-parallel size 2 = 4"),
    (["--step-batch-size-schedule", "0:4 64:16"], "ends at batch size 16 but --global-batch-size is 8"),
    (["--train-samples", "100"], "--train-iters and --train-samples both give the training length"),
])
def test_bad_schedules_fail_at_start_up(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(TINY_GPT + extra, world_size=2)


def test_training_length_from_samples_and_tokens():
    argv = [a for a in TINY_GPT]
    i = argv.index("--train-iters")
    del argv[i:i + 2]
    assert parse_args(argv + ["--train-samples", "100"], world_size=1).train.train_iters == 12  # whole batches of 8
    # --train-tokens: the step that reaches 1000 tokens (63 samples of 16) is the 8th
    assert parse_args(argv + ["--train-tokens", "1000"], world_size=1).train.train_iters == 8
    assert parse_args(argv + ["--train-samples", "400", "--train-tokens", "1000"], world_size=1).train.train_iters == 8
    with pytest.raises(ConfigError, match="no training length"):
        parse_args(argv, world_size=1)
