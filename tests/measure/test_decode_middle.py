"""A decode probe times steps at the generation's middle, not just after the prompt (review, 2026-12-07).

A step's attention reads the whole cache, so its time grows with the position; timed right after the prefill, a
long generation looked 2.5x faster than it ran. Here a decoder sleeps in proportion to its cache's length: the mean
step over positions 100 … 399 is 1.25 ms, the first one 0.5 ms.
"""

from __future__ import annotations

import time

import pytest
import torch

from microbatch.measure.probes import DecodeProbe, decode_lead
from microbatch.measure.timing import TimingConfig

PER_POSITION_S = 5e-6


class _Growing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.positions: list[int] = []

    def prefill(self, prompt: torch.Tensor, capacity: int):
        return torch.zeros(prompt.shape[0], 8), prompt.shape[1]

    def decode_step(self, tok: torch.Tensor, cache: int):
        time.sleep(cache * PER_POSITION_S)
        self.positions.append(cache)
        return torch.zeros(tok.shape[0], 8), cache + 1


def test_a_long_decode_is_timed_at_its_mean_step():
    model = _Growing()
    probe = DecodeProbe(
        model, vocab=8, seq=400, new_tokens=300, timing=TimingConfig(clock="wall", rel_tol=0.5)
    )
    got = probe.measure(2)
    mean = (100 + 399) / 2 * PER_POSITION_S  # 1.25 ms; the first step's 0.5 ms is what the old timing read
    assert 0.85 * mean < got.step_time_s < 1.6 * mean, got.step_time_s
    assert max(model.positions) < 400  # never past the cache's capacity


@pytest.mark.parametrize("new_tokens", [22, 32, 100, 1984])
def test_the_lead_centres_the_timed_steps_and_leaves_room_for_the_most_the_timing_takes(new_tokens):
    t = TimingConfig()  # warm-up 2, 3 to 20 repeats
    lead = decode_lead(new_tokens, t)
    assert 0 <= lead and lead + t.warmup + t.max_repeats <= new_tokens
    first_timed = lead + t.warmup
    if new_tokens >= 2 * (
        t.warmup + t.max_repeats
    ):  # room to centre: the minimum repeats straddle the middle
        assert first_timed <= new_tokens // 2 <= first_timed + t.min_repeats
    assert decode_lead(t.warmup + t.max_repeats, t) == 0  # no room: timed from the prompt's end, as before
