"""Migration in the router: a worker that fails a request mid-stream is replaced, the stream goes
on from where it was, and past `max_migrations` the request fails naming every failed worker.
The workers are stand-ins (a fake `run_flow`); the real thing is in
tests/e2e/test_zz_worker_loss.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

import router.generation as generation
from router.config import RouterConfig
from router.errors import RequestFailed, WorkerFailed
from router.flow import TokenEvent
from router.generation import GenerationService
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from router.text import RouterTokenizer
from splitserve.roles import Role
from splitserve.v1 import common_pb2, generation_pb2, registry_pb2

STOP_AFTER = 3  # tokens each failing worker streams before it dies


def _service(model_dir: Path, workers: int, max_migrations: int) -> GenerationService:
    registry = WorkerRegistry()
    for i in range(workers):
        registry._add(f"w{i}", Role.COLOCATED, f"127.0.0.1:{9 + i}", model_dir.name,
                      registry_pb2.WorkerCapacity())
    cfg = RouterConfig(model_dir=str(model_dir), max_migrations=max_migrations)
    return GenerationService(cfg, registry, RouterTokenizer(model_dir), model_dir.name,
                             RouterMetrics(CollectorRegistry(), model_dir.name))


def _fake_flow(calls: list, dying: set[str]):
    """Each worker continues the count from the prompt's length; those in `dying` fail after
    STOP_AFTER tokens, as a worker that is SIGKILLed does."""
    async def run_flow(rid, prompt_ids, sampling, prefill, decode, deadline, timings):
        calls.append((decode.worker_id, len(prompt_ids), sampling.max_tokens))
        for k in range(sampling.max_tokens):
            if decode.worker_id in dying and k == STOP_AFTER:
                raise WorkerFailed(decode.worker_id, f"decode on {decode.worker_id} failed")
            last = k == sampling.max_tokens - 1
            yield TokenEvent([100 + len(prompt_ids) + k],
                             finish_reason=common_pb2.FINISH_REASON_LENGTH if last else None)
    return run_flow


def _run(make, n: int, setup=lambda svc: None) -> tuple[list[int], GenerationService]:
    """Build the service inside the event loop (its worker channels need one), then stream."""
    async def main():
        svc = make()
        setup(svc)
        return await _tokens(svc, n), svc
    return asyncio.run(main())


async def _tokens(svc: GenerationService, n: int) -> list[int]:
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3, 4]),
                                         sampling=common_pb2.SamplingParams(max_tokens=n),
                                         skip_detokenize=True)
    out = []
    async for chunk in svc.stream(req, None, svc.tracker.track()):
        out += chunk.token_ids
    return out


def test_a_failed_worker_is_replaced_and_the_stream_goes_on(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    # Whichever two workers the router tries first die; the third finishes.
    order: list[str] = []

    def spy_on_route(svc: GenerationService) -> None:
        real_route = svc.route

        def route(prompt_len, local, exclude=(), prompt_ids=()):
            p, d = real_route(prompt_len, local, exclude, prompt_ids)
            order.append(d.worker_id)
            return p, d

        svc.route = route

    dying: set[str] = set()
    flow = _fake_flow(calls, dying)

    async def first_two_die(*a):
        if len(order) <= 2:
            dying.add(order[-1])
        async for ev in flow(*a):
            yield ev

    monkeypatch.setattr(generation, "run_flow", first_two_die)
    got, svc = _run(lambda: _service(tiny_model_dir, workers=3, max_migrations=2), 10,
                    spy_on_route)
    assert got == [100 + 4 + k for k in range(10)]  # no gap, no repeat
    assert len(set(order)) == 3  # a failed worker is not tried again for this request
    # Each new worker got the prompt plus what was already streamed, and only what is left.
    assert [(n, m) for _, n, m in calls] == [(4, 10), (7, 7), (10, 4)]
    assert svc.tracker.metrics.migrations_m._value.get() == 2


def test_past_the_limit_unavailable_names_the_failed_workers(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    monkeypatch.setattr(generation, "run_flow", _fake_flow(calls, {"w0", "w1", "w2"}))
    with pytest.raises(RequestFailed) as e:
        _run(lambda: _service(tiny_model_dir, workers=3, max_migrations=1), 10)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    failed = [w for w, _, _ in calls]
    assert len(failed) == 2 and all(w in str(e.value) for w in failed), str(e.value)


def test_no_worker_left_names_the_ones_that_failed(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "run_flow", _fake_flow([], {"w0"}))
    with pytest.raises(RequestFailed) as e:
        _run(lambda: _service(tiny_model_dir, workers=1, max_migrations=2), 10)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "w0" in str(e.value)
