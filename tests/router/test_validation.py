"""Request validation: each rule rejects exactly its field, defaults are filled in."""

from __future__ import annotations

import grpc
import pytest

from router.errors import RequestFailed
from router.outcome import outcome_of
from router.validation import (
    InvalidArgument,
    RequestLimits,
    check_model,
    validate_prompt,
    validate_sampling,
)
from splitserve.sampling import Sampling
from splitserve.v1 import common_pb2, generation_pb2

VOCAB, CTX = 4096, 4096


def sampling(prompt_len: int = 10, max_model_len: int = CTX, **fields) -> Sampling:
    return validate_sampling(
        common_pb2.SamplingParams(**fields), prompt_len=prompt_len, max_model_len=max_model_len,
        vocab_size=VOCAB,
    )


def rejects(field: str, fn, *args, **kwargs) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.field == field
    assert str(err) == f"{field}: {err.message}"
    assert str(err).startswith(field + ": ")
    return err


def test_error_format() -> None:
    err = InvalidArgument("sampling.temperature", "must be in [0, 2], got 3.0")
    assert isinstance(err, RequestFailed) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (outcome_of(err).label, outcome_of(err).http_status) == ("invalid", 400)
    assert str(err) == "sampling.temperature: must be in [0, 2], got 3.0"


def test_defaults() -> None:
    assert sampling() == Sampling(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=16,
        min_tokens=0,
        seed=None,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
        logprobs=None,
        stream_interval=1,
    )


def test_all_fields_pass_through() -> None:
    v = sampling(
        temperature=0.0,
        top_p=0.5,
        top_k=40,
        max_tokens=100,
        min_tokens=5,
        seed=0,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9],
        ignore_eos=True,
        logprobs=0,
        stream_interval=4,
    )
    assert v == Sampling(0.0, 0.5, 40, 100, 5, 0, ("\n\n", "END"), (7, 9), True, 0, 4)
    # Workers get all but the stop strings, and read back the same record.
    assert Sampling.from_proto(v.to_proto()) == Sampling(0.0, 0.5, 40, 100, 5, 0, (), (7, 9),
                                                         True, 0, 4)


def test_stream_interval_one_is_not_sent() -> None:
    assert not sampling(stream_interval=1).to_proto().HasField("stream_interval")
    assert Sampling.from_proto(common_pb2.SamplingParams()).stream_interval == 1


def test_float32_values_come_back_as_written() -> None:
    assert sampling(temperature=0.7, top_p=0.9).temperature == 0.7
    assert sampling(top_p=0.9).top_p == 0.9


def test_unset_max_tokens_is_capped_to_context() -> None:
    assert sampling(prompt_len=4090, max_model_len=4096).max_tokens == 6
    assert sampling(prompt_len=4095, max_model_len=4096).max_tokens == 1


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_disabled(top_k: int) -> None:
    assert sampling(top_k=top_k).top_k == -1


@pytest.mark.parametrize(
    ("field", "fields", "needle"),
    [
        ("sampling.temperature", {"temperature": 3.0}, "must be in [0, 2], got 3.0"),
        ("sampling.temperature", {"temperature": -0.1}, "got -0.1"),
        ("sampling.temperature", {"temperature": float("nan")}, "nan"),
        ("sampling.top_p", {"top_p": 0.0}, "(0, 1]"),
        ("sampling.top_p", {"top_p": 1.5}, "(0, 1]"),
        ("sampling.top_p", {"top_p": float("nan")}, "nan"),
        ("sampling.top_k", {"top_k": -2}, ">= -1"),
        ("sampling.max_tokens", {"max_tokens": 0}, ">= 1"),
        ("sampling.min_tokens", {"min_tokens": -1}, ">= 0"),
        ("sampling.min_tokens", {"max_tokens": 5, "min_tokens": 6}, "max_tokens (5)"),
        ("sampling.min_tokens", {"min_tokens": 17}, "max_tokens (16)"),  # default max_tokens
        ("sampling.stop", {"stop": ["ok", ""]}, "empty"),
        ("sampling.stop_token_ids", {"stop_token_ids": [3, -1]}, "-1"),
        ("sampling.stop_token_ids", {"stop_token_ids": [3, VOCAB]}, f"[0, {VOCAB})"),
        ("sampling.stop_token_ids", {"stop_token_ids": list(range(257))}, "at most 256"),
        ("sampling.stop", {"stop": ["x"] * 17}, "at most 16 stop strings, got 17"),
        ("sampling.stop", {"stop": ["ok", "y" * 1025]}, "stop string 1 has 1025 characters"),
        ("sampling.logprobs", {"logprobs": 21}, "[0, 20]"),
        ("sampling.logprobs", {"logprobs": -1}, "[0, 20]"),
        ("sampling.stream_interval", {"stream_interval": 0}, "got 0"),
        ("sampling.stream_interval", {"stream_interval": -3}, "[1, "),
    ],
)
def test_sampling_rules(field: str, fields: dict, needle: str) -> None:
    err = rejects(field, sampling, **fields)
    assert needle in err.message


def test_prompt_plus_max_tokens_must_fit() -> None:
    assert sampling(prompt_len=96, max_model_len=128, max_tokens=32).max_tokens == 32
    err = rejects("sampling.max_tokens", sampling, prompt_len=100, max_model_len=128, max_tokens=29)
    assert "100" in err.message and "29" in err.message and "128" in err.message


def test_limits_are_inclusive_and_configurable() -> None:
    assert len(sampling(stop=["x" * 1024] * 16, stop_token_ids=list(range(256))).stop) == 16
    tight = RequestLimits(max_stop_strings=1, max_stop_chars=2, max_stop_token_ids=1)
    sp = common_pb2.SamplingParams(stop=["abc"])
    err = rejects("sampling.stop", validate_sampling, sp, prompt_len=1, max_model_len=CTX,
                  limits=tight)
    assert "at most 2" in err.message
    with pytest.raises(ValueError, match="max_stop_chars"):
        RequestLimits(max_stop_chars=0)


def test_logprobs_bounds_accepted() -> None:
    assert sampling(logprobs=20).logprobs == 20
    assert sampling(logprobs=0).logprobs == 0


def prompt(**fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(**fields)


def check_prompt(req: generation_pb2.GenerateRequest, **kw) -> None:
    validate_prompt(req, vocab_size=VOCAB, max_model_len=kw.pop("max_model_len", CTX), **kw)


def test_valid_prompts() -> None:
    check_prompt(prompt(text="hi"))
    check_prompt(prompt(text="hi"), prompt_len=CTX - 1)
    check_prompt(prompt(token_ids=generation_pb2.TokenIds(ids=[0, VOCAB - 1])))
    check_prompt(prompt(token_ids=generation_pb2.TokenIds(ids=[5] * 7)), max_model_len=8)


def test_prompt_rules() -> None:
    rejects("prompt", check_prompt, prompt())
    rejects("text", check_prompt, prompt(text=""))
    rejects("token_ids", check_prompt, prompt(token_ids=generation_pb2.TokenIds(ids=[])))
    out_of_vocab = prompt(token_ids=generation_pb2.TokenIds(ids=[1, VOCAB]))
    err = rejects("token_ids", check_prompt, out_of_vocab)
    assert "4096" in err.message and "position 1" in err.message
    rejects("token_ids", check_prompt, prompt(token_ids=generation_pb2.TokenIds(ids=[-1])))
    # Long prompts are checked another way (numpy); the same rule and the same message.
    long = [7] * 3000
    check_prompt(prompt(token_ids=generation_pb2.TokenIds(ids=[0, *long, VOCAB - 1])))
    for bad, pos in ((VOCAB, 2999), (-3, 1234)):
        ids = list(long)
        ids[pos] = bad
        err = rejects("token_ids", check_prompt, prompt(token_ids=generation_pb2.TokenIds(ids=ids)))
        assert f"id {bad} at position {pos}" in err.message, err.message
    err = rejects(
        "token_ids",
        check_prompt,
        prompt(token_ids=generation_pb2.TokenIds(ids=[5] * 8)),
        max_model_len=8,
    )
    assert "8 tokens" in err.message
    rejects("text", check_prompt, prompt(text="long"), prompt_len=CTX)
    check_prompt(prompt(text="hi", request_id="r" * 256))
    err = rejects("request_id", check_prompt, prompt(text="hi", request_id="r" * 257))
    assert "257" in err.message


def test_check_model() -> None:
    check_model("", {"tiny"})
    check_model("tiny", {"tiny", "bench"})
    err = rejects("model", check_model, "gpt-9", {"tiny", "bench"})
    assert "gpt-9" in err.message and "bench, tiny" in err.message
