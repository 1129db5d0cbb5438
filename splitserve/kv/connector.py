"""SplitServeConnector: vLLM 0.32's KV connector API, pulling KV over torch.distributed.

vLLM builds one instance per process role: the SCHEDULER half in the engine-core process decides
*which* blocks move, the WORKER half in the worker process moves them (producer.py, consumer.py).
They share nothing; the scheduler half sends `SplitServeMeta` to the worker once per step,
which acts on it before that step's forward pass.
What crosses between engines is a `KVTicket` (ticket.py), carried in vLLM's kv_transfer_params.

Request lifecycle, producer (prefill) engine, params `produce_params(transfer_id)`:
  run with max_tokens=1 → request_finished: status LENGTH_CAPPED → keep the blocks (delay free),
  queue them to be held under the router's transfer id, return the ticket.
  A request that stopped on EOS, was aborted or errored will not be decoded: blocks freed at once.
Request lifecycle, consumer (decode) engine, params `ticket.to_vllm()`:
  get_num_new_matched_tokens: the producer's tokens beyond our own prefix-cache hit are external,
  loaded in the step that schedules the request, before its forward pass (`load="sync"`;
  "layered": beside it; a failure then reports the blocks as invalid), or asynchronously
  (`load="async"`) → update_state_after_alloc:
  queue a pull of exactly the blocks we lack
  (the tail of the producer's list) into our fresh blocks, clear the consume flag so that a
  recompute never pulls twice → worker pulls → finished_recving (failed_recving on error, and
  vLLM applies kv_load_failure_policy: "fail" ends the request, "recompute" prefills locally).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from splitserve import faults
from splitserve.kv.consumer import Consumer, PullJob
from splitserve.kv.layered import LayeredScatter
from splitserve.kv.producer import Producer
from splitserve.kv.settings import ConnectorSettings
from splitserve.kv.spec import KVSpec, spec_from_caches
from splitserve.kv.stats import TransferSample, TransferStats
from splitserve.kv.ticket import CONSUME, PRODUCE, KVTicket, TransferId, produced_transfer_id

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HoldJob:
    transfer_id: TransferId
    req_id: str
    block_ids: list[int]


@dataclass
class SplitServeMeta(KVConnectorMetadata):
    hold: list[HoldJob] = field(default_factory=list)
    pull: list[PullJob] = field(default_factory=list)
    release: list[KVTicket] = field(default_factory=list)


@dataclass
class SplitServeHandshake(KVConnectorHandshakeMetadata):
    # Worker → scheduler at start-up: what tickets must say about this producer.
    side_channel_port: int  # where pulls go (the worker bound port 0)
    spec_fingerprint: str


@dataclass
class SplitServeStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = TransferSample.from_dict(self.data) if self.data else TransferSample()
        if other.data:
            merged.merge(TransferSample.from_dict(other.data))
        self.data = merged.to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        s = TransferSample.from_dict(self.data) if self.data else TransferSample()
        gbps = s.bytes / s.seconds / 1e9 if s.seconds else 0.0
        return {"transfers": s.transfers, "bytes": s.bytes, "seconds": round(s.seconds, 6),
                "gbps": round(gbps, 3), "failures": s.failures, "lease_expired": s.lease_expired,
                "shm_transfers": s.shm_transfers, "arena_transfers": s.arena_transfers}

    def is_empty(self) -> bool:
        return not self.data or TransferSample.from_dict(self.data).is_empty()


class SplitServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(ktc.kv_connector_extra_config or {}))
        self._faults = faults.for_host(self.settings.host)
        self.engine_id = ktc.engine_id
        self.is_producer = ktc.is_kv_producer
        self.is_consumer = ktc.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        # scheduler half
        self._side_channel_port = self.settings.side_channel_port  # real one set at start-up
        self._spec_fingerprint = ""  # set at start-up, from the worker half's handshake
        self._to_hold: list[HoldJob] = []
        self._to_pull: list[PullJob] = []
        self._to_release: list[KVTicket] = []
        # worker half
        self._vllm_config = vllm_config
        self.stats = TransferStats()
        self.spec: KVSpec | None = None  # read off the caches at registration
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._load_errors: set[int] = set()  # blocks of failed in-step loads, for vLLM
        self._layer_index: dict[str, int] = {}  # layer name -> its place in the caches' order
        self._layered: tuple[PullJob, LayeredScatter, Future[str | None]] | None = None
        self._cpu_caches = False

    # ===================================== scheduler half ====================================
    def _ticket(self, request: Request) -> KVTicket | None:
        """The ticket of a decode request that still has to pull, else None."""
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get(CONSUME)):
            return None
        return KVTicket.from_vllm(params)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        ticket = self._ticket(request)
        if ticket is None:
            return 0, False
        count = _claimable(request, ticket) - num_computed_tokens
        return (count, self.settings.load == "async") if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        ticket = self._ticket(request)
        if ticket is None:
            return
        request.kv_transfer_params[CONSUME] = False  # whatever happens next, never pull twice
        if num_external_tokens <= 0:  # our prefix cache already has everything
            self._to_release.append(ticket)
            return
        # Our fresh blocks hold the tail of the claimed range (the head is our prefix-cache
        # hit), so they pair with the tail of the producer's blocks up to the claimed end.
        claimable = _claimable(request, ticket)
        end = -(-claimable // self.block_size)
        sync = self.settings.load != "async"
        if sync:
            # Blocks loaded in the step are cached (hashed) at allocation, so "unhashed" does
            # not name them: take them by position, from the end of our own prefix hit.
            start = (claimable - num_external_tokens) // self.block_size
            local = blocks.get_block_ids()[0][start:end]
        else:
            local = blocks.get_unhashed_block_ids()
        remote = list(ticket.block_ids[max(end - len(local), 0):end])
        if len(remote) != len(local):
            log.error("request %s: %d fresh blocks but the producer holds only %d to match",
                      request.request_id, len(local), len(remote))
        corrupt = (self._faults.corrupt_on_request
                   and request.kv_transfer_params.get("fault") == "corrupt")
        pulled = list(local)[:len(remote)]
        # In-step: the pulled block the step also writes (the first new token's slot), if the
        # prompt ends mid-block and that block is ours to pull.
        tail = (pulled[-1] if sync and claimable % self.block_size and pulled
                and len(pulled) == len(local) else None)
        self._to_pull.append(PullJob(request.request_id, ticket, pulled, remote, corrupt,
                                     sync=sync, tail_block=tail))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SplitServeMeta(hold=self._to_hold, pull=self._to_pull, release=self._to_release)
        self._to_hold, self._to_pull, self._to_release = [], [], []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if self.is_producer and params.get(PRODUCE):
            # Only a request cut at max_tokens=1 goes on to decode; EOS, abort or error: free now.
            if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
                return False, None
            tid = produced_transfer_id(params)
            self._to_hold.append(HoldJob(tid, request.request_id, list(block_ids)))
            ticket = KVTicket(tid, self.engine_id, self.settings.host, self._side_channel_port,
                              tuple(block_ids), request.num_computed_tokens,
                              time.time() + self.settings.lease_s, self._spec_fingerprint)
            return True, ticket.to_vllm()
        ticket = self._ticket(request)
        if ticket is not None:
            # Finished (aborted) before it was ever scheduled: let the producer free early.
            params[CONSUME] = False
            self._to_release.append(ticket)
        return False, None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        """The worker bound its side channel (maybe on port 0) and read its cache's spec."""
        for meta in metadata.values():
            if isinstance(meta, SplitServeHandshake) and meta.side_channel_port:
                self._side_channel_port = meta.side_channel_port
                self._spec_fingerprint = meta.spec_fingerprint

    # ====================================== worker half ======================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self._vllm_config.model_config.served_model_name
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._cpu_caches = next(iter(kv_caches.values())).device.type == "cpu"
        self.spec = spec_from_caches(str(model), self.block_size, kv_caches,
                                     str(self._vllm_config.cache_config.cache_dtype))
        if self.is_producer:
            device = next(iter(kv_caches.values())).device
            self.producer = Producer(self.engine_id, self.settings, self.stats,
                                     copy_out=self.settings.copies_out(device.type))
            self.producer.start(kv_caches, self.spec)
        if self.is_consumer:
            self.consumer = Consumer(self.engine_id, self.settings, self.stats)
            self.consumer.start(kv_caches, self.spec)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.producer is None:
            return None
        assert self.spec is not None
        return SplitServeHandshake(self.producer.side_port, self.spec.fingerprint())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The one place the worker half acts on a step's metadata: vLLM binds it once per step,
        before the forward pass. (start_load_kv comes after the forward when no load is
        in-step, and on a CPU the forward is synchronous, so a hold, and the pull that waits on
        it, or a pull would wait for the whole step there: a long prefill.)"""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        assert isinstance(meta, SplitServeMeta)
        for h in meta.hold:
            assert self.producer is not None
            self.producer.hold(h.transfer_id, h.req_id, h.block_ids)
        # The step's last in-step load may run beside the forward (layered.py).
        beside = (next((j for j in reversed(meta.pull) if j.sync), None)
                  if self._layers_beside() else None)
        for job in meta.pull:
            assert self.consumer is not None
            if not job.sync:
                self.consumer.submit(job)
            elif job is beside:
                # The last one: the forward overlaps its scatter (the others are in place by
                # then; loads from one producer take turns, so only one can run beside it).
                self._layered = (job, *self.consumer.load_layered(job))
            elif not self.consumer.load_now(job):
                self._load_errors.update(job.local_block_ids)
        for ticket in meta.release:
            assert self.consumer is not None
            self.consumer.release(ticket)

    def _layers_beside(self) -> bool:
        """Whether in-step loads overlap the forward (layered.py): CPU caches only. On a GPU
        the engine thread only queues the copies on the device's stream, ahead of the forward's
        kernels; overlapping them there would take a second stream (not built)."""
        return self.settings.load == "layered" and self._cpu_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # the step's loads started (or, in-step, ran) when its metadata was bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Async loads: the request is not scheduled until they finish; whole in-step loads
        # are done before the forward. A layered one may still be scattering this layer.
        if self._layered is not None:
            last = len(self._layer_index) - 1  # a layer we do not know: wait for them all
            self._layered[1].wait_layer(self._layer_index.get(layer_name, last))

    def _join_layered(self) -> None:
        """After the forward: the layered load's end, its blocks reported if it failed."""
        if self._layered is not None:
            job, _, done = self._layered
            self._layered = None
            if done.result() is not None:
                self._load_errors.update(job.local_block_ids)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # pull model: nothing is pushed while computing

    def wait_for_save(self) -> None:
        self._join_layered()  # the first hook after the forward (nothing is saved: pull model)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.producer is not None:
            out.finished_sending = self.producer.take_finished()
        if self.consumer is not None:
            for r in self.consumer.take_results():
                out.finished_recving.add(r.req_id)
                if not r.ok:
                    out.failed_recving.add(r.req_id)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """In-step loads that failed: vLLM recomputes (or fails) what those blocks held."""
        self._join_layered()
        out, self._load_errors = self._load_errors, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        sample = self.stats.drain()
        return None if sample.is_empty() else SplitServeStats(data=sample.to_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return SplitServeStats(data=data or {})

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.shutdown()
        if self.consumer is not None:
            self.consumer.shutdown()



def _claimable(request: Request, ticket: KVTicket) -> int:
    """Prompt tokens whose KV the producer holds and we may take. vLLM must compute at least one
    token itself to get logits, so the last prompt token is never claimed."""
    return min(ticket.num_tokens, len(request.prompt_token_ids) - 1)
