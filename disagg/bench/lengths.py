"""Token-length distributions for prompts and outputs (``--isl 200:50`` = mean 200, stddev 50).

A normal distribution clipped to [1, mean + 4 stddev], as aiperf's and genai-perf's ``--isl``/``--isl-stddev``
draw them; stddev 0 gives every request exactly the mean, so two tools given the same numbers
send the same lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["LengthDist", "parse_length"]


@dataclass(frozen=True)
class LengthDist:
    mean: int
    stddev: int = 0

    def sample(self, rng: random.Random) -> int:
        if self.stddev == 0:
            return self.mean
        value = round(rng.gauss(self.mean, self.stddev))
        return max(1, min(value, self.mean + 4 * self.stddev))

    def __str__(self) -> str:
        return f"{self.mean}:{self.stddev}" if self.stddev else str(self.mean)


def parse_length(text: str, name: str) -> LengthDist:
    """``MEAN`` or ``MEAN:STDDEV``, both integers; a ValueError naming the option otherwise."""
    mean_text, _, stddev_text = text.partition(":")
    try:
        mean, stddev = int(mean_text), int(stddev_text or 0)
    except ValueError:
        raise ValueError(f"{name}: expected MEAN or MEAN:STDDEV (integers), got {text!r}") from None
    if mean < 1 or stddev < 0:
        raise ValueError(f"{name}: mean must be >= 1 and stddev >= 0, got {text!r}")
    return LengthDist(mean, stddev)
