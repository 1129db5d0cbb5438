"""Latency targets (service-level objectives) that a load test scores requests against and the
Ray autoscaler sizes pools for."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass(frozen=True)
class SLO:
    """Latency targets in milliseconds; None means no target for that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {f.name} must be a finite number > 0, got {v}")

    @classmethod
    def parse(cls, s: str) -> SLO:
        """'ttft=500,tpot=50,e2el=3000' (any subset, ms); vLLM's 'ttft:500 tpot:50' works too."""
        kw: dict[str, float] = {}
        for item in s.replace(",", " ").split():
            key, sep, val = item.replace(":", "=").partition("=")
            name = _SLO_KEYS.get(key.strip().lower())
            if not sep or name is None:
                raise ValueError(f"bad SLO item {item!r}: expected KEY=MS with KEY in "
                                 f"{sorted(_SLO_KEYS)}")
            if name in kw:
                raise ValueError(f"SLO key {key!r} given twice in {s!r}")
            try:
                kw[name] = float(val)
            except ValueError:
                raise ValueError(f"bad SLO value in {item!r}: not a number") from None
        return cls(**kw)

    def __str__(self) -> str:
        parts = [f"{k}={getattr(self, name):g}" for k, name in _SLO_KEYS.items()
                 if getattr(self, name) is not None]
        return ",".join(parts)

    def meets(self, r: Any) -> bool:
        """Succeeded and within every target that is set. A 1-token output has no TPOT and so
        cannot miss the TPOT target; a request with no streamed token misses any TTFT target."""
        return self.meets_times(r.ok, r.ttft, r.tpot, r.e2e)

    def meets_times(self, ok: bool, ttft_s: float | None, tpot_s: float | None,
                    e2e_s: float) -> bool:
        """`meets` for a request known by its times (a result file's per-request row)."""
        if not ok:
            return False
        if self.ttft_ms is not None and (ttft_s is None or ttft_s * 1e3 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and tpot_s is not None and tpot_s * 1e3 > self.tpot_ms:
            return False
        return self.e2el_ms is None or e2e_s * 1e3 <= self.e2el_ms
