"""What a starting worker's engine is doing, read from the worker's log, for `up`'s console.

vLLM marks each phase of an engine's start with a line of its own; the last marker in the log is
the phase the engine is in. A compiled engine spends most of its first start on a host compiling
(the tiny model: 19 s on one core, SmolLM2: about a minute; later starts read the compile cache),
and a console that said nothing for that long would look hung.
"""

from __future__ import annotations

from pathlib import Path

COMPILING = ("compiling the model (torch.compile; kept in the compile cache for later starts on "
             "this host)")
# (marker in vLLM's log, what the console says), in the order an engine passes them.
PHASES = (
    ("Starting to load model", "loading the model"),
    # CPU: one warm-up traces and compiles the whole forward (a cache hit is quick).
    ("Warming up model for the compilation", COMPILING),
    # GPU: vLLM's backend compiles piecewise, then captures the CUDA graphs.
    ("Compiling a graph for", COMPILING),
    ("Capturing CUDA graphs", "capturing CUDA graphs"),
)


def phase(text: str) -> str | None:
    """The phase the last marker in `text` names (None before the first)."""
    found = [(text.rfind(marker), said) for marker, said in PHASES if marker in text]
    return max(found)[1] if found else None


class LogWatch:
    """A log file read on from where the last read stopped, and the phase it last named."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.phase = path, 0, None

    def changed(self) -> str | None:
        """The new phase, once, when the log has moved on to one; else None."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                raw = f.read()
        except OSError:
            return None
        # A line may be cut at the end of the read: the partial one is read again next time.
        cut = raw.rfind(b"\n") + 1
        self.offset += cut
        now = phase(raw[:cut].decode(errors="replace"))
        if now is None or now == self.phase:
            return None
        self.phase = now
        return now
