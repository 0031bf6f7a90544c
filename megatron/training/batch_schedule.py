"""The global batch size as a function of the samples consumed so far (Megatron's num-microbatches calculator).

Constant (``--global-batch-size``), ramped up (``--rampup-batch-size START INCREMENT SAMPLES``: from START,
INCREMENT more every SAMPLES / increments samples, the full size once SAMPLES are consumed) or in steps
(``--step-batch-size-schedule "0:16 2.4B:320 ..."``: thresholds in tokens, K/M/B/T suffixes). The formulas
are Megatron-LM's, so a resumed run picks up the batch size where the first one left it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


@dataclass(frozen=True)
class BatchSchedule:
    final: int  # --global-batch-size: the size once any ramp-up or schedule is done
    rampup: tuple[int, int, int] | None = None  # --rampup-batch-size (start, increment, samples)
    steps: tuple[tuple[int, int], ...] = ()  # --step-batch-size-schedule as (from sample, size), ascending

    def __post_init__(self):
        if self.final <= 0:
            raise ValueError(f"--global-batch-size must be > 0 (got {self.final})")
        if self.rampup is not None:
            start, increment, samples = self.rampup
            if start <= 0 or increment <= 0 or samples < 0:
                raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: need start > 0, "
                                 "increment > 0 and ramp-up samples >= 0")
            if start > self.final or (self.final - start) % increment:
                raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size "
                                 f"{self.final} must be start + a multiple of the increment")
        if self.steps:
            if self.steps[0][0] != 0:
                raise ValueError("--step-batch-size-schedule: the first entry must start at 0 (e.g. \"0:16 ...\")")
            if self.steps[-1][1] != self.final:
                raise ValueError(f"--step-batch-size-schedule ends at batch size {self.steps[-1][1]} but "
                                 f"--global-batch-size is {self.final}; drop --global-batch-size or make them equal")

    @property
    def constant(self) -> bool:
        return (self.rampup is None or self.rampup[0] == self.final) and len(self.steps) <= 1

    def sizes(self) -> list[int]:
        """Every global batch size the schedule can take."""
        if self.rampup is not None:
            start, increment, _ = self.rampup
            return list(range(start, self.final + 1, increment))
        return [size for _, size in self.steps] or [self.final]

    def global_batch_size(self, consumed_samples: int) -> int:
        """The batch of the iteration that starts after ``consumed_samples``."""
        if self.rampup is not None:
            start, increment, samples = self.rampup
            if consumed_samples > samples or start == self.final or samples == 0:
                return self.final
            per_increment = samples / ((self.final - start) // increment)
            return start + int(consumed_samples / per_increment) * increment
        size = self.final
        for threshold, step_size in self.steps:
            if consumed_samples < threshold:
                break
            size = step_size
        return size

    def _final_from(self) -> int:
        """Consumed samples from which every batch is ``final``."""
        if self.rampup is not None:
            return self.rampup[2] + 1
        return self.steps[-1][0] if self.steps else 0

    def samples_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed = done = 0
        while done < iterations and consumed < self._final_from():
            consumed += self.global_batch_size(consumed)
            done += 1
        return consumed + (iterations - done) * self.final

    def iterations_for(self, samples: int, until_reached: bool = False) -> int:
        """Iterations to consume ``samples``: whole batches of a constant size, as Megatron-LM (the last partial
        batch is dropped), or, with a schedule or ``until_reached``, until the count is reached."""
        if self.constant and not until_reached:
            return samples // self.final
        consumed = iterations = 0
        while consumed < samples and consumed < self._final_from():
            consumed += self.global_batch_size(consumed)
            iterations += 1
        return iterations + max(0, math.ceil((samples - consumed) / self.final))


def parse_count(text: str, flag: str) -> int:
    """``2.4B`` -> 2_400_000_000 (suffixes K, M, B, T), as Megatron-LM reads schedule entries."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    if multiplier != 1:
        value = value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number (suffixes K, M, B, T allowed)") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{flag}: {text!r} must be a finite number >= 0")
    return int(number * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """``"0:16 2.4B:320"`` (token thresholds) -> ((0, 16), (2.4e9 // seq_length, 320)) in samples."""
    flag = "--step-batch-size-schedule"
    steps = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. \"0:16 2.4B:320\")")
        threshold, size = entry.split(":", 1)
        batch = parse_count(size, flag)
        if batch <= 0:
            raise ValueError(f"{flag}: entry {entry!r} has batch size {batch}; batch sizes must be > 0")
        steps.append((parse_count(threshold, flag) // seq_length, batch))
    if not steps:
        raise ValueError(f"{flag} is empty; give THRESHOLD:BATCH_SIZE entries (e.g. \"0:16 2.4B:320\")")
    steps.sort()
    if any(a[0] == b[0] for a, b in zip(steps, steps[1:])):
        raise ValueError(f"{flag} {text!r}: two entries start at the same sample; thresholds must differ")
    return tuple(steps)
