"""SplitServeConnector: vLLM 0.32's KV connector API, pulling KV over torch.distributed.

vLLM builds one instance per process role: the SCHEDULER half in the engine-core process decides
*which* blocks move, the WORKER half in the worker process moves them (producer.py, consumer.py).
They share nothing; the scheduler half sends `SplitServeMeta` to the worker once per step.

Request lifecycle, producer (prefill) engine, params {"do_remote_decode": True}:
  run with max_tokens=1 → request_finished: status LENGTH_CAPPED → keep the blocks (delay free),
  queue them to be held, return params the decode side needs (see `_params_for_decode`).
  A request that stopped on EOS, was aborted or errored will not be decoded: blocks freed at once.
Request lifecycle, consumer (decode) engine, params {"do_remote_prefill": True, ...}:
  get_num_new_matched_tokens: the producer's tokens beyond our own prefix-cache hit are external,
  loaded asynchronously → update_state_after_alloc: queue a pull of exactly the blocks we lack
  (the tail of the producer's list) into our fresh blocks, clear do_remote_prefill so that a
  recompute never pulls twice → worker pulls → finished_recving (failed_recving on error, and
  vLLM applies kv_load_failure_policy: "fail" ends the request, "recompute" prefills locally).
"""

from __future__ import annotations

import logging
import os
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

from splitserve.kv.consumer import Consumer, PullJob
from splitserve.kv.producer import Producer
from splitserve.kv.spec import spec_from_caches
from splitserve.kv.stats import TransferSample, TransferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, typed. Defaults work for a one-host cluster."""

    host: str = "127.0.0.1"  # address peers use to reach this worker (side channel, gloo)
    side_channel_port: int = 0  # producer: 0 = any free port (the worker reports the real one)
    lease_s: float = 30.0  # producer: held blocks are freed if nobody pulls within this
    timeout_s: float = 10.0  # every network wait of a transfer
    secret: str | None = None  # shared secret; falls back to $SPLITSERVE_KV_SECRET
    # Tests only: honour a request's {"fault": "corrupt"} (flip received bytes, proving the KV
    # really travels). Off unless a deployment turns it on, so clients cannot use it.
    allow_fault_injection: bool = False
    stall_before_send_s: float = 0.0  # producer: pause mid-transfer (tests kill it there)
    # producer: "copy" copies held blocks out and frees them at once, "blocks" keeps vLLM's
    # blocks until pulled, "auto" = copy on CPU (a busy engine costs cores there), blocks on GPU
    # (device memory is the scarce thing there).
    hold: str = "auto"

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        s = cls(**extra)
        if s.hold not in ("auto", "copy", "blocks"):
            raise ValueError(f"hold must be auto, copy or blocks, got {s.hold!r}")
        if s.secret is None and os.environ.get("SPLITSERVE_KV_SECRET"):
            s = cls(**{**extra, "secret": os.environ["SPLITSERVE_KV_SECRET"]})
        return s


@dataclass
class SplitServeMeta(KVConnectorMetadata):
    hold: dict[str, list[int]] = field(default_factory=dict)  # transfer id → producer blocks
    pull: list[PullJob] = field(default_factory=list)
    release: list[tuple[str, str, int, str | None]] = field(default_factory=list)


@dataclass
class SplitServeHandshake(KVConnectorHandshakeMetadata):
    side_channel_port: int  # worker → scheduler at start-up: where pulls should go


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
                "gbps": round(gbps, 3), "failures": s.failures, "lease_expired": s.lease_expired}

    def is_empty(self) -> bool:
        return not self.data or TransferSample.from_dict(self.data).is_empty()


class SplitServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(ktc.kv_connector_extra_config or {}))
        self.engine_id = ktc.engine_id
        self.is_producer = ktc.is_kv_producer
        self.is_consumer = ktc.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        # scheduler half
        self._side_channel_port = self.settings.side_channel_port  # real one set at start-up
        self._to_hold: dict[str, list[int]] = {}
        self._to_pull: list[PullJob] = []
        self._to_release: list[tuple[str, str, int, str | None]] = []
        # worker half
        self._vllm_config = vllm_config
        self.stats = TransferStats()
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._last_meta: KVConnectorMetadata | None = None

    # ===================================== scheduler half ====================================
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get("do_remote_prefill")):
            return 0, False
        count = self._claimable(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    @staticmethod
    def _claimable(request: Request) -> int:
        """Prompt tokens whose KV the producer holds and we may take. vLLM must compute at
        least one token itself to get logits, so the last prompt token is never claimed."""
        remote = int(request.kv_transfer_params["remote_num_tokens"])
        return min(remote, len(request.prompt_token_ids) - 1)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # whatever happens next, never pull twice
        if num_external_tokens <= 0:  # our prefix cache already has everything
            self._to_release.append(_peer_of(params))
            return
        # Our fresh blocks hold the tail of the claimed range (the head is our prefix-cache
        # hit), so they pair with the tail of the producer's blocks up to the claimed end.
        local = blocks.get_unhashed_block_ids()
        end = -(-self._claimable(request) // self.block_size)
        remote = list(params["remote_block_ids"])[max(end - len(local), 0):end]
        if len(remote) != len(local):
            log.error("request %s: %d fresh blocks but the producer holds only %d to match",
                      request.request_id, len(local), len(remote))
        self._to_pull.append(PullJob(
            req_id=request.request_id, transfer_id=str(params["transfer_id"]),
            host=str(params["remote_host"]), port=int(params["remote_port"]),
            engine_id=params.get("remote_engine_id"),
            local_block_ids=list(local)[:len(remote)], remote_block_ids=remote,
            corrupt=self.settings.allow_fault_injection and params.get("fault") == "corrupt"))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SplitServeMeta(hold=self._to_hold, pull=self._to_pull, release=self._to_release)
        self._to_hold, self._to_pull, self._to_release = {}, [], []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if self.is_producer and params.get("do_remote_decode"):
            # Only a request cut at max_tokens=1 goes on to decode; EOS, abort or error: free now.
            if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
                return False, None
            self._to_hold[request.request_id] = list(block_ids)
            return True, self._params_for_decode(request, block_ids)
        if self.is_consumer and params.get("do_remote_prefill"):
            # Finished (aborted) before it was ever scheduled: let the producer free early.
            params["do_remote_prefill"] = False
            self._to_release.append(_peer_of(params))
        return False, None

    def _params_for_decode(self, request: Request, block_ids: list[int]) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "transfer_id": request.request_id,  # internal id: unique per engine
            "remote_engine_id": self.engine_id,
            "remote_host": self.settings.host,
            "remote_port": self._side_channel_port,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": request.num_computed_tokens,
            "lease_s": self.settings.lease_s,
        }

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        """The worker bound its side channel (maybe on port 0); advertise the real port."""
        for meta in metadata.values():
            if isinstance(meta, SplitServeHandshake) and meta.side_channel_port:
                self._side_channel_port = meta.side_channel_port

    # ====================================== worker half ======================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self._vllm_config.model_config.served_model_name
        spec = spec_from_caches(str(model), self.block_size, kv_caches)
        s = self.settings
        if self.is_producer:
            device = next(iter(kv_caches.values())).device
            copy_out = s.hold == "copy" or (s.hold == "auto" and device.type == "cpu")
            self.producer = Producer(self.engine_id, s.host, s.side_channel_port, s.lease_s,
                                     s.timeout_s, s.secret, self.stats, s.stall_before_send_s,
                                     copy_out=copy_out)
            self.producer.start(kv_caches, spec)
        if self.is_consumer:
            self.consumer = Consumer(self.engine_id, s.host, s.timeout_s, s.secret, self.stats)
            self.consumer.start(kv_caches, spec)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.producer is None:
            return None
        return SplitServeHandshake(side_channel_port=self.producer.side_port)

    def _take_meta(self) -> None:
        """Act on this step's metadata once (it is visible to several hooks per step)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if meta is self._last_meta:
            return
        self._last_meta = meta
        assert isinstance(meta, SplitServeMeta)
        for tid, ids in meta.hold.items():
            assert self.producer is not None
            self.producer.hold(tid, ids)
        for job in meta.pull:
            assert self.consumer is not None
            self.consumer.submit(job)
        for tid, host, port, engine_id in meta.release:
            assert self.consumer is not None
            self.consumer.release(tid, host, port, engine_id)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._take_meta()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-request async loads: the request is not scheduled until they finish

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # pull model: nothing is pushed while computing

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._take_meta()
        out = KVConnectorTransferResults()
        if self.producer is not None:
            out.finished_sending = self.producer.take_finished()
        if self.consumer is not None:
            for r in self.consumer.take_results():
                out.finished_recving.add(r.req_id)
                if not r.ok:
                    out.failed_recving.add(r.req_id)
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


def _peer_of(params: dict[str, Any]) -> tuple[str, str, int, str | None]:
    return (str(params["transfer_id"]), str(params["remote_host"]), int(params["remote_port"]),
            params.get("remote_engine_id"))
