"""Finish reasons: the one table between vLLM's and OpenAI's words ("stop", "length", ...) and the
proto enum that carries them between components."""

from __future__ import annotations

from splitserve.v1 import common_pb2

_BY_WORD = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_BY_VALUE = {v: k for k, v in _BY_WORD.items()}


def to_proto(word: str | None) -> int:
    """vLLM's finish reason (None while running) as the proto enum (UNSPECIFIED if unknown)."""
    return _BY_WORD.get(word or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def to_word(value: int) -> str | None:
    """The proto enum as OpenAI's word; None for UNSPECIFIED."""
    return _BY_VALUE.get(value)
