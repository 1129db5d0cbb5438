"""Read a Prometheus /metrics page back into numbers: one sample family, summed by one label.

The benchmarks (where a conditional router placed its prefills), the Ray autoscaler (its
scrapes) and the e2e and Ray tests (requests by outcome, migrations, a gauge) all read these
pages; they fetch them here and read them through prometheus-client's own parser, rather than
by splitting lines.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def fetch(url: str, timeout_s: float = 10.0) -> str:
    """The page at `url` (a /metrics URL), as text."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def by_label(text: str, sample: str, label: str) -> dict[str, float]:
    """The values of the samples named `sample` (a counter's `..._total`), summed by `label`'s
    value: {"local": 12.0, "remote": 30.0} for the router's routing decisions by "prefill"."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample:
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def total(text: str, sample: str) -> float:
    """The sum over every sample named `sample` (one gauge or counter, whatever its labels)."""
    return sum(by_label(text, sample, "").values())
