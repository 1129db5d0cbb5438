"""What every benchmark writes beside its figures: the CPU they were measured on.

Machines differ by several times between sessions (an AVX-512 Xeon against an AVX2 EPYC), so a
figure without its CPU model cannot be compared with anything.
"""

from __future__ import annotations

import os
import platform


def machine() -> dict:
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        lines = []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
               platform.processor())
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    return {"cpu": cpu, "cores": os.cpu_count(), "avx512": "avx512f" in flags,
            "python": platform.python_version()}
