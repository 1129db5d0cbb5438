"""When requests are sent: seeded arrival processes for open-loop load.

Open loop (send on schedule, never wait for replies) is what makes latency under load meaningful:
a closed loop slows its own arrivals when the server slows, hiding queueing. Gaps follow
vLLM's benchmark_serving convention:
  poisson   exponential gaps with mean 1/rate;
  gamma     gamma gaps, shape=burstiness, scale=1/(rate*burstiness): the same mean rate, with
            coefficient of variation 1/sqrt(burstiness) (1 == Poisson, < 1 burstier, > 1 smoother);
  constant  gaps of exactly 1/rate.
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("poisson", "gamma", "constant")


def arrival_times(
    n: int, rate: float, kind: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """n send times in seconds from the start of the run, nondecreasing.

    The first request goes at 0 (the run starts with a send, not with an idle gap), so the times
    are 0, g1, g1+g2, ... and n requests span n-1 gaps: the mean rate is (n-1) / times[-1].
    rate=inf sends everything at 0 (a burst, as vLLM's --request-rate inf). burstiness applies to
    kind='gamma' only; passing another value with another kind is an error, not silently ignored.
    """
    if not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be finite and > 0, got {burstiness}")
    if kind != "gamma" and burstiness != 1.0:
        raise ValueError(f"burstiness={burstiness} only applies to kind='gamma', not {kind!r}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n

    if kind == "constant":
        # i/rate rather than a running sum: no drift from accumulated rounding.
        return (np.arange(n) / rate).tolist()
    rng = np.random.default_rng(seed)
    m = n - 1
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=m)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=m)
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    return times.tolist()
