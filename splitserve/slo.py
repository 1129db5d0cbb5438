"""Latency targets (service-level objectives) that a load test scores requests against and the
Ray autoscaler sizes pools for. Seconds, like every other duration in splitserve; written with an
explicit unit on the command line (`ttft=500ms,tpot=50ms`, `ttft=0.5s`) so that an old
milliseconds-only spelling (`ttft=500`) fails loudly instead of meaning 500 s."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

_SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2el_s"}
# unit: how many make a second. Longest suffix first: "500ms" must not read as "500m" seconds.
_UNITS = (("ms", 1e3), ("s", 1.0))


def _seconds(item: str, val: str) -> float:
    """'500ms' -> 0.5, '0.5s' -> 0.5; a bare number is refused (it used to mean milliseconds)."""
    text = val.strip().lower()
    for unit, per_second in _UNITS:
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                return float(number) / per_second
            except ValueError:
                raise ValueError(f"bad SLO value in {item!r}: {number!r} is not a number") \
                    from None
    try:
        n = float(text)
    except ValueError:
        raise ValueError(f"bad SLO value in {item!r}: write a number with a unit, ms or s "
                         f"(e.g. 500ms or 0.5s)") from None
    raise ValueError(f"SLO value {val!r} has no unit: write {n:g}ms or {n / 1e3:g}s")


def _written(v: float) -> str:
    """`v` seconds as parse reads it back exactly: ms below a second, else seconds."""
    ms = f"{v * 1e3:.12g}ms"
    if v < 1 and _seconds(ms, ms) == v:
        return ms
    return f"{v!r}".removesuffix(".0") + "s"


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; None means no target for that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2el_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {f.name} must be a finite number > 0, got {v}")

    @classmethod
    def parse(cls, s: str) -> SLO:
        """'ttft=500ms,tpot=50ms,e2el=3s' (any subset, each value with its unit, ms or s);
        vLLM's 'ttft:500ms tpot:50ms' spelling works too (with the units)."""
        kw: dict[str, float] = {}
        for item in s.replace(",", " ").split():
            key, sep, val = item.replace(":", "=").partition("=")
            name = _SLO_KEYS.get(key.strip().lower())
            if not sep or name is None:
                raise ValueError(f"bad SLO item {item!r}: expected KEY=VALUE with a unit "
                                 f"(e.g. ttft=500ms) and KEY in {sorted(_SLO_KEYS)}")
            if name in kw:
                raise ValueError(f"SLO key {key!r} given twice in {s!r}")
            kw[name] = _seconds(item, val)
        return cls(**kw)

    def __str__(self) -> str:
        return ",".join(f"{k}={_written(getattr(self, name))}" for k, name in _SLO_KEYS.items()
                        if getattr(self, name) is not None)

    def meets(self, r: Any) -> bool:
        """Succeeded and within every target that is set. A 1-token output has no TPOT and so
        cannot miss the TPOT target; a request with no streamed token misses any TTFT target."""
        return self.meets_times(r.ok, r.ttft, r.tpot, r.e2e)

    def meets_times(self, ok: bool, ttft_s: float | None, tpot_s: float | None,
                    e2e_s: float) -> bool:
        """`meets` for a request known by its times in seconds (a result file's per-request
        row)."""
        if not ok:
            return False
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return False
        return self.e2el_s is None or e2e_s <= self.e2el_s
