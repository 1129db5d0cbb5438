"""How long a CPU engine's processes spin while they wait for each other, and why briefly.

On CPU, vLLM's EngineCore and its model runner hand each step over a shared-memory queue. A
reader of that queue (the runner waiting for the next step, the EngineCore waiting for a step's
output) spins on `sched_yield` for a second after every message before it sleeps on the queue's
socket notification (`SpinCondition`, `busy_loop_s = 1`). One engine on a many-core host can
afford that. `splitserve up` on two cores cannot: with an engine on each core, one reader or
another spins nearly all the time a request runs, and a yield hands the core only to threads of
the spinner's own session (docs/benchmarks.md, "One session for the whole cluster"). Every
other program on the host then waits: a client in another session, beside a process using a
third of a core, got each stream's tokens late and all at once, while the router had written
them on time (figures: docs/benchmarks.md, "Beside other work and under a burst").

So a worker's engine processes spin for `SPIN_S` after a message, then sleep until the writer's
notification wakes them (an event: the writer notifies on every message). Steps follow each
other within a millisecond or two under load, so the short spin still catches them. A sleeping
reader also looks again every `POLL_S`: the notification can be lost (the writer's socket drops
one while its previous one is unsent, `SNDHWM` 1), and vLLM's own recheck is 5 s — a colocated
stream beside a CPU hog once waited out exactly those 5 s with nothing else wrong.
`--spin-s` sets it (EngineConfig.spin_s, handed to the engine's processes in
$SPLITSERVE_ENGINE_SPIN_S; vLLM's own 1 s: `--spin-s 1`). Loaded in
every vLLM process as a `vllm.general_plugins` entry point (pyproject.toml), it acts only in the
engines of splitserve's workers on CPU: plain vLLM started from the same environment, and GPU
engines, keep vLLM's behaviour.
"""

from __future__ import annotations

import os

from splitserve.lifeline import ENGINE_PARENT_ENV

SPIN_S = 0.002
POLL_S = 0.01  # the longest a lost notification can hold a sleeping reader
SPIN_ENV = "SPLITSERVE_ENGINE_SPIN_S"
VLLM_WAIT = "_splitserve_vllm_wait"  # where the patched class keeps vLLM's own wait


def spin_s() -> float:
    value = float(os.environ.get(SPIN_ENV, SPIN_S))
    if not value >= 0:
        raise ValueError(f"{SPIN_ENV} must be a number of seconds >= 0, got {value}")
    return value


def engine_plugin() -> None:
    """vLLM general plugin: shortens the spin of shared-memory queue readers in this process
    (see the module docstring)."""
    if ENGINE_PARENT_ENV not in os.environ:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    limit_spin(spin_s())


def limit_spin(seconds: float) -> None:
    """Every `SpinCondition` reader in this process, made before or after, spins at most
    `seconds` after a message (the class is patched: readers may already exist)."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    cls._splitserve_spin_s = seconds
    if VLLM_WAIT in cls.__dict__:  # patched already (plugins load more than once): new limit
        return
    vllm_wait = cls.wait

    def short_wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = min(self.busy_loop_s, cls._splitserve_spin_s)
        poll_ms = round(POLL_S * 1000)
        vllm_wait(self, poll_ms if timeout_ms is None else min(timeout_ms, poll_ms))

    setattr(cls, VLLM_WAIT, vllm_wait)
    cls.wait = short_wait
