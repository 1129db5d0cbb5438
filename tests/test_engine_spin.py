"""The short spin of a worker engine's queue readers (splitserve/engine_spin.py), on a real
vLLM `SpinCondition` reader in this process (no engine)."""

from __future__ import annotations

import time

import pytest

from splitserve import engine_spin
from splitserve.lifeline import ENGINE_PARENT_ENV


@pytest.fixture
def spin_condition(monkeypatch, tmp_path):
    zmq = pytest.importorskip("zmq")
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    # vLLM's own class for the test, whatever an engine built in this process did to it (an
    # in-process engine loads the plugin here too); restored afterwards.
    monkeypatch.setattr(cls, "wait", cls.__dict__.get(engine_spin.VLLM_WAIT, cls.wait))
    monkeypatch.delattr(cls, engine_spin.VLLM_WAIT, raising=False)
    monkeypatch.delattr(cls, "_splitserve_spin_s", raising=False)
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = cls(is_reader=False, context=ctx, notify_address=address)
    reader = cls(is_reader=True, context=ctx, notify_address=address)
    yield cls, reader, writer
    for s in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
              writer.local_notify_socket):
        s.close(linger=0)
    ctx.term()


def test_a_reader_made_before_the_patch_spins_briefly_then_sleeps_until_notified(
        spin_condition, monkeypatch) -> None:
    cls, reader, writer = spin_condition
    assert reader.busy_loop_s == 1  # vLLM's: a second of sched_yield after every message
    monkeypatch.setattr(engine_spin, "POLL_S", 5.0)  # long, so only the notification wakes it
    engine_spin.limit_spin(0.002)
    reader.record_read()
    time.sleep(0.01)  # past the short spin: the next wait sleeps on the socket
    t0 = time.monotonic()
    reader.wait(timeout_ms=300)  # nothing written: it sleeps out its timeout
    assert reader.busy_loop_s == 0.002
    assert time.monotonic() - t0 >= 0.25
    writer.notify()
    t0 = time.monotonic()
    reader.wait(timeout_ms=5000)  # the notification wakes it: an event, not the timeout
    assert time.monotonic() - t0 < 2.5


def test_a_sleeping_reader_looks_again_within_the_poll_interval(spin_condition) -> None:
    """A lost notification holds a reader for POLL_S at most, not vLLM's 5 s recheck."""
    _, reader, _ = spin_condition
    engine_spin.limit_spin(0.002)
    reader.record_read()
    time.sleep(0.01)
    t0 = time.monotonic()
    reader.wait(timeout_ms=5000)  # nothing written, nothing notified
    assert time.monotonic() - t0 < 2.5


def test_only_a_workers_engine_is_changed(spin_condition, monkeypatch) -> None:
    cls, reader, _ = spin_condition
    monkeypatch.delenv(ENGINE_PARENT_ENV, raising=False)
    engine_spin.engine_plugin()  # plain vLLM from the same environment: left as vLLM made it
    reader.wait(timeout_ms=1)
    assert reader.busy_loop_s == 1
    monkeypatch.setenv(ENGINE_PARENT_ENV, "1")
    monkeypatch.setenv(engine_spin.SPIN_ENV, "0.05")
    engine_spin.engine_plugin()
    reader.wait(timeout_ms=1)
    assert reader.busy_loop_s == 0.05


def test_a_bad_setting_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(engine_spin.SPIN_ENV, "-1")
    with pytest.raises(ValueError, match=engine_spin.SPIN_ENV):
        engine_spin.spin_s()
