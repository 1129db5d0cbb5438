"""Chat prompts: `GenerateRequest.messages` is rendered with the model's own template, once, in
the router (router/chat.py via GenerationService.prepare), for gRPC and HTTP alike."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.config import RouterConfig
from router.errors import InvalidArgument
from router.generation import GenerationService
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from router.text import RouterTokenizer
from splitserve.v1 import generation_pb2


def _service(model_dir: Path) -> GenerationService:
    return GenerationService(RouterConfig(model_dir=str(model_dir)), WorkerRegistry(),
                             RouterTokenizer(model_dir), "m",
                             RouterMetrics(CollectorRegistry(), "m"))


def _chat(*turns: tuple[str, str]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(messages=generation_pb2.ChatMessages(messages=[
        generation_pb2.ChatMessage(role=r, content=c) for r, c in turns]))


def test_messages_are_rendered_with_the_models_template_like_transformers(
        tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    turns = [("system", "be brief"), ("user", "hello there"), ("assistant", "hi"),
             ("user", "what now?")]
    ids, _, _ = _service(tiny_model_dir).prepare(_chat(*turns))
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    want = hf.apply_chat_template([{"role": r, "content": c} for r, c in turns],
                                  add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids == list(want)  # generation prompt included, special tokens not doubled


def test_empty_conversation_and_missing_role_name_the_field(tiny_model_dir: Path) -> None:
    svc = _service(tiny_model_dir)
    for req in (_chat(), _chat(("", "hi"))):
        with pytest.raises(InvalidArgument) as e:
            svc.prepare(req)
        assert e.value.field == "messages"


def test_a_model_without_a_template_refuses_messages(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    cfg = (bare / "tokenizer_config.json")
    cfg.write_text(cfg.read_text().replace('"chat_template"', '"unused_template"'))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    svc = _service(bare)
    assert svc.chat is None
    with pytest.raises(InvalidArgument, match="no chat template") as e:
        svc.prepare(_chat(("user", "hi")))
    assert e.value.field == "messages"


def test_a_template_that_raises_is_an_invalid_argument(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    strict = tmp_path / "strict"
    shutil.copytree(tiny_model_dir, strict)
    (strict / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    svc = _service(strict)
    with pytest.raises(InvalidArgument, match="user first"):
        svc.prepare(_chat(("assistant", "hi")))
    ids, _, _ = svc.prepare(_chat(("user", "hi")))
    assert ids == RouterTokenizer(strict).encode("hi", add_special_tokens=False)
