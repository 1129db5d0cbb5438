"""Sampling parameters as one typed record, with the server's defaults written down once.

The router fills it from a request (validating each field, router/validation.py) and sends it to
workers as the proto; a worker reads the proto back with `from_proto` (a worker can be called
directly, so unset fields get the same defaults there) and hands it to vLLM. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16  # when a request does not say (capped to the context left)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # matched by the router on text; never sent to workers
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    stream_interval: int = 1  # tokens per streamed message, at least (first and last: at once)

    @classmethod
    def from_proto(cls, sp: common_pb2.SamplingParams) -> Sampling:
        """Unset fields take the defaults above; no validation (the router's job)."""
        d = cls()
        return cls(
            temperature=sp.temperature if sp.HasField("temperature") else d.temperature,
            top_p=sp.top_p if sp.HasField("top_p") else d.top_p,
            top_k=(sp.top_k or -1) if sp.HasField("top_k") else d.top_k,
            max_tokens=sp.max_tokens if sp.HasField("max_tokens") else d.max_tokens,
            min_tokens=sp.min_tokens,
            seed=sp.seed if sp.HasField("seed") else None,
            stop=tuple(sp.stop),
            stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            stream_interval=max(sp.stream_interval, 1) if sp.HasField("stream_interval")
            else d.stream_interval,
        )

    def to_proto(self) -> common_pb2.SamplingParams:
        """What a worker needs: everything but the stop strings, which the router keeps."""
        sp = common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)
        if self.seed is not None:
            sp.seed = self.seed
        if self.logprobs is not None:
            sp.logprobs = self.logprobs
        if self.stream_interval > 1:
            sp.stream_interval = self.stream_interval
        return sp
