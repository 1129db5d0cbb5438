"""Proto messages ↔ vLLM objects, in one place for all worker roles.

The router has validated every field already; workers still refuse what vLLM would choke on
(a worker can be called directly), via ValueError → INVALID_ARGUMENT in the servicers.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from splitserve.v1 import common_pb2


def sampling_to_vllm(sp: common_pb2.SamplingParams, *, max_tokens: int | None = None,
                     min_tokens: int | None = None,
                     kv_transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    """`max_tokens`/`min_tokens` override the request's (prefill runs 1 token, decode the rest).

    Stop strings are the router's job (it sees the detokenised text across both workers), so
    they are not passed to vLLM; stop token ids are.
    """
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=(sp.top_k or -1) if sp.HasField("top_k") else -1,
        max_tokens=max_tokens if max_tokens is not None else
        (sp.max_tokens if sp.HasField("max_tokens") else 16),
        min_tokens=min_tokens if min_tokens is not None else sp.min_tokens,
        seed=sp.seed if sp.HasField("seed") else None,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,  # the router detokenises once, incrementally
        extra_args=extra,
    )


FINISH_REASONS = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def finish_reason_to_proto(reason: str | None) -> int:
    return FINISH_REASONS.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


# vLLM-side params (see splitserve/kv/connector.py) ↔ the proto the router carries opaquely.
def kv_params_to_proto(p: dict[str, Any]) -> common_pb2.KvTransferParams:
    return common_pb2.KvTransferParams(
        engine_id=str(p.get("remote_engine_id") or ""), host=str(p["remote_host"]),
        port=int(p["remote_port"]), block_ids=[int(b) for b in p["remote_block_ids"]],
        num_tokens=int(p["remote_num_tokens"]), transfer_id=str(p["transfer_id"]),
        extra={"lease_s": str(p.get("lease_s", ""))})


def kv_params_from_proto(m: common_pb2.KvTransferParams) -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": m.transfer_id,
            "remote_engine_id": m.engine_id or None, "remote_host": m.host,
            "remote_port": m.port, "remote_block_ids": list(m.block_ids),
            "remote_num_tokens": m.num_tokens}


def first_logprob(output: Any) -> float | None:
    """Logprob of the sampled token of a one-token output, when logprobs were requested."""
    if not output.logprobs:
        return None
    token = output.token_ids[0]
    entry = output.logprobs[0].get(token)
    return None if entry is None else float(entry.logprob)
