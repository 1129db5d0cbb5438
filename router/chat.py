"""Chat templates: a conversation → the prompt text the model was trained on.

One renderer for every front door: a gRPC `GenerateRequest.messages` prompt and an HTTP
`/v1/chat/completions` body both reach `GenerationService.prepare` as messages and are rendered
here, then tokenised without adding special tokens (the template writes them). The template is the
model directory's own (Hugging Face's Jinja dialect), compiled once at start-up and run in jinja2's
immutable sandbox as transformers does: it is code that came with a model, not code we wrote.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.errors import InvalidArgument, RequestFailed


class _Refused(jinja2.TemplateError):
    """The template's own raise_exception(): it will not render this conversation."""


def _raise(message: str) -> None:  # templates call raise_exception() on conversations they refuse
    raise _Refused(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        # The immutable sandbox: unsandboxed Jinja reaches Python internals (and the process)
        # through attributes like `__class__`, and a mutable one could change the messages.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: Iterable[tuple[str, str]]) -> str:
        """(role, content) pairs → prompt text, ending with the assistant's turn opened.
        A conversation the template refuses is the client's error (INVALID_ARGUMENT); a template
        that fails otherwise, the sandbox's SecurityError included, is the model's (INTERNAL)."""
        turns = [{"role": role, "content": content} for role, content in messages]
        try:
            return self._template.render(messages=turns, add_generation_prompt=True,
                                         **self._tokens)
        except _Refused as e:
            raise InvalidArgument("messages", f"the chat template refused them: {e}") from e
        except jinja2.TemplateError as e:
            raise RequestFailed(grpc.StatusCode.INTERNAL,
                                f"the model's chat template failed: {e}") from e
