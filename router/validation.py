"""Request validation at the router's front door.

Lifecycle: for every Generate/Complete call the servicer first runs `check_model`, then
`validate_prompt` (before and, for text, after tokenising: the length check needs the token
count), then `validate_sampling` with the prompt length. Any `InvalidArgument` becomes a gRPC
INVALID_ARGUMENT (HTTP 400) carrying `str(err)`, e.g. "sampling.temperature: must be in [0, 2],
got 3.0"; nothing reaches a worker. The returned `Sampling` has every default filled in, so
code downstream never checks proto field presence again (defaults: splitserve/sampling.py).

Field names in errors are proto paths ("sampling.top_p", "token_ids", ...) so clients can map
them back to what they sent. Only stdlib, numpy and generated protobuf modules: no torch, no vllm.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from router.errors import InvalidArgument
from splitserve.sampling import DEFAULT_MAX_TOKENS, Sampling
from splitserve.settings import setting
from splitserve.v1 import common_pb2, generation_pb2

MAX_LOGPROBS = 20  # what the OpenAI API allows; the engines are configured to match
MAX_REQUEST_ID_CHARS = 256  # it names the request in every worker's ids and logs
# Beyond this a stream is one message at the end anyway (max_tokens is at most the context).
MAX_STREAM_INTERVAL = 1 << 20
_DEFAULTS = Sampling()
# Prompts of up to this many token ids are range-checked in a Python loop, longer ones with numpy:
# the loop's cost grows with the prompt (all of it before the first token), numpy's does not,
# but on a short prompt, with the router's caches cold after an idle spell, numpy costs more.
_LOOP_MAX_IDS = 256


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask of the router, checked before any work is done. Each
    is a router flag (made from the field: splitserve/settings.py), in docs/operations.md."""

    # OpenAI allows 4 stop strings; vLLM no limit. Matching is linear either way.
    max_stop_strings: int = setting(16, "stop strings per request")
    max_stop_chars: int = setting(1024, "characters per stop string")
    max_stop_token_ids: int = setting(256, "stop_token_ids per request")
    # A prompt at a 32k context is ~200 KB of JSON token ids; 8 MiB leaves room for long texts
    # without letting one body fill the router.
    max_request_bytes: int = setting(8 << 20, "HTTP body / gRPC message size")
    max_timeout_s: float = setting(3600.0, "largest HTTP `timeout` field accepted")

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_chars", "max_stop_token_ids",
                     "max_request_bytes", "max_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _number(field: str, value: float) -> float:
    # NaN slips through every range comparison, so reject it explicitly.
    if math.isnan(value):
        raise InvalidArgument(field, "must be a number, got nan")
    # Proto floats are float32: 0.7 arrives as 0.699999988... Seven significant digits give back
    # the value the client wrote, for the engine and for error messages alike.
    return float(f"{value:.7g}")


def validate_sampling(
    sp: common_pb2.SamplingParams,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int | None = None,
    limits: RequestLimits = RequestLimits(),
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Sampling:
    """Check `sp` against the rules below and fill in defaults; raise InvalidArgument."""
    d = _DEFAULTS
    temperature = d.temperature
    if sp.HasField("temperature"):
        temperature = _number("sampling.temperature", sp.temperature)
        if not 0.0 <= temperature <= 2.0:
            raise InvalidArgument("sampling.temperature", f"must be in [0, 2], got {temperature}")

    top_p = d.top_p
    if sp.HasField("top_p"):
        top_p = _number("sampling.top_p", sp.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {top_p}")

    top_k = d.top_k
    if sp.HasField("top_k"):
        if sp.top_k < -1:
            raise InvalidArgument("sampling.top_k", f"must be >= -1, got {sp.top_k}")
        top_k = -1 if sp.top_k == 0 else sp.top_k  # 0 and -1 both mean "disabled"

    room = max_model_len - prompt_len
    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
        if max_tokens < 1:
            raise InvalidArgument("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
        if prompt_len + max_tokens > max_model_len:
            raise InvalidArgument(
                "sampling.max_tokens",
                f"prompt length {prompt_len} + max_tokens {max_tokens} exceeds the model's "
                f"context length {max_model_len}",
            )
    else:
        # Unset means "server default", which must not itself fail the request: cap it to the
        # context left after the prompt (validate_prompt guarantees at least one token of room).
        max_tokens = max(1, min(default_max_tokens, room))

    min_tokens = sp.min_tokens
    if min_tokens < 0:
        raise InvalidArgument("sampling.min_tokens", f"must be >= 0, got {min_tokens}")
    if min_tokens > max_tokens:
        raise InvalidArgument(
            "sampling.min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}"
        )

    if len(sp.stop) > limits.max_stop_strings:
        raise InvalidArgument("sampling.stop", f"at most {limits.max_stop_strings} stop strings, "
                                               f"got {len(sp.stop)}")
    for i, s in enumerate(sp.stop):
        if not s:
            raise InvalidArgument("sampling.stop", f"stop string {i} is empty")
        if len(s) > limits.max_stop_chars:
            raise InvalidArgument("sampling.stop", f"stop string {i} has {len(s)} characters; "
                                                   f"at most {limits.max_stop_chars}")
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument("sampling.stop_token_ids",
                              f"at most {limits.max_stop_token_ids} ids, "
                              f"got {len(sp.stop_token_ids)}")
    for t in sp.stop_token_ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise InvalidArgument("sampling.stop_token_ids",
                                  f"id {t} is outside the vocabulary [0, {vocab_size})"
                                  if t >= 0 else f"must be >= 0, got {t}")

    logprobs: int | None = None
    if sp.HasField("logprobs"):
        logprobs = sp.logprobs
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                "sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}"
            )

    stream_interval = d.stream_interval
    if sp.HasField("stream_interval"):
        stream_interval = sp.stream_interval
        if not 1 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise InvalidArgument("sampling.stream_interval",
                                  f"must be in [1, {MAX_STREAM_INTERVAL}], got {stream_interval}")

    return Sampling(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=logprobs,
        stream_interval=stream_interval,
    )


def validate_prompt(
    req: generation_pb2.GenerateRequest,
    *,
    vocab_size: int,
    max_model_len: int,
    prompt_len: int | None = None,
) -> None:
    """Check the request's prompt; raise InvalidArgument.

    Token-id prompts are checked fully. A text prompt's length is only known after tokenising:
    pass `prompt_len` (its token count) to have that checked too.
    """
    if req.HasField("request_id") and len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, "
                                            f"got {len(req.request_id)}")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("prompt", "a prompt must be given (text, token_ids or messages)")
    if kind == "text":
        if not req.text:
            raise InvalidArgument("text", "must not be empty")
        if prompt_len is not None:
            _check_len("text", prompt_len, max_model_len)
        return
    if kind == "messages":
        turns = req.messages.messages
        if not turns:
            raise InvalidArgument("messages", "must not be empty")
        for i, m in enumerate(turns):
            if not m.role:
                raise InvalidArgument("messages", f"message {i} has no role")
        if prompt_len is not None:
            _check_len("messages", prompt_len, max_model_len)
        return
    ids = req.token_ids.ids
    if not ids:
        raise InvalidArgument("token_ids", "must not be empty")
    if len(ids) <= _LOOP_MAX_IDS:
        bad = next((p for p, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    else:  # one pass in C
        a = np.array(ids, dtype=np.int64)
        bad = (int(np.flatnonzero((a < 0) | (a >= vocab_size))[0])
               if a.min() < 0 or a.max() >= vocab_size else None)
    if bad is not None:
        raise InvalidArgument("token_ids", f"id {ids[bad]} at position {bad} is outside the "
                                           f"vocabulary [0, {vocab_size})")
    _check_len("token_ids", len(ids), max_model_len)


def _check_len(field: str, n: int, max_model_len: int) -> None:
    # Strictly less: at least one generated token must fit in the context window.
    if n >= max_model_len:
        raise InvalidArgument(
            field,
            f"prompt has {n} tokens; it must be shorter than the model's context length "
            f"{max_model_len}",
        )


def check_model(requested: str, served: Collection[str]) -> None:
    """An empty name selects the default model; any other must be one the router serves."""
    if requested and requested not in served:
        names = ", ".join(sorted(served)) or "(none)"
        raise InvalidArgument("model", f"model {requested!r} is not served; served: {names}")
