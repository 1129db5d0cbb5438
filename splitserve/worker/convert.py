"""Proto messages ↔ vLLM objects, in one place for all worker roles.

The router has validated every field already; workers still refuse what vLLM would choke on
(a worker can be called directly), via ValueError → INVALID_ARGUMENT in the servicers.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from splitserve.sampling import Sampling
from splitserve.v1 import common_pb2


def sampling_to_vllm(sp: common_pb2.SamplingParams, *, max_tokens: int | None = None,
                     min_tokens: int | None = None,
                     kv_transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    """`max_tokens`/`min_tokens` override the request's (prefill runs 1 token, decode the rest).

    Stop strings are the router's job (it sees the detokenised text across both workers), so
    they are not passed to vLLM; stop token ids are.
    """
    s = Sampling.from_proto(sp)
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        min_tokens=s.min_tokens if min_tokens is None else min_tokens,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        output_kind=RequestOutputKind.DELTA,
        # vLLM holds tokens back until this many are ready (first and last at once): fewer
        # messages through the worker, the router and the client for the same tokens.
        stream_interval=s.stream_interval if s.stream_interval > 1 else None,
        detokenize=False,  # the router detokenises once, incrementally
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


def first_logprob(output: Any) -> float | None:
    """Logprob of the sampled token of a one-token output, when logprobs were requested."""
    if not output.logprobs:
        return None
    token = output.token_ids[0]
    entry = output.logprobs[0].get(token)
    return None if entry is None else float(entry.logprob)
