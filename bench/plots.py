"""PNG plots of a load test: SLO attainment vs rate, latency CDFs, server-side breakdown."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.metrics import RequestResult  # noqa: E402


def attainment_vs_rate(series: dict[str, list[tuple[float, float]]], target: float,
                       path: Path) -> Path:
    """One line per deployment: SLO attainment (fraction) at each request rate."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        rates, att = zip(*sorted(points))
        ax.plot(rates, [a * 100 for a in att], marker="o", label=label)
    ax.axhline(target * 100, color="grey", linestyle="--", linewidth=1,
               label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def latency_cdfs(groups: dict[str, list[RequestResult]], path: Path) -> Path:
    """TTFT and TPOT CDFs, one curve per group (deployment or rate)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, results in groups.items():
        ok = [r for r in results if r.ok]
        for ax, values in ((axes[0], [r.ttft for r in ok if r.ttft is not None]),
                           (axes[1], [r.tpot for r in ok if r.tpot is not None])):
            if values:
                xs = np.sort(np.asarray(values) * 1e3)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def breakdown(rows: dict[str, dict[str, float]], path: Path) -> Path:
    """Stacked mean server-side time per request: queue, prefill, transfer, decode."""
    parts = ("queue", "prefill", "transfer", "decode")
    labels = list(rows)
    fig, ax = plt.subplots(figsize=(max(5, len(labels) * 1.2), 4))
    bottom = np.zeros(len(labels))
    for part in parts:
        values = np.array([rows[k].get(f"mean_{part}_ms", 0.0) or 0.0 for k in labels])
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom += values
    ax.set_ylabel("mean time per request (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelrotation=20)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
