"""Text handling in the router: tokenise prompts, stream-detokenise outputs, match stop strings.

Lifecycle: the router builds one `RouterTokenizer` per served model at start-up (it reads only the
model directory's JSON files, never weights). For each request it encodes the prompt once, then
creates one `IncrementalDetokenizer` and one `StopMatcher`. Every token batch streamed back by a
decode worker goes `ids -> IncrementalDetokenizer.push -> StopMatcher.feed -> client`; when the
worker finishes, `IncrementalDetokenizer.flush` then `StopMatcher.feed`/`flush` drain what was held
back. Workers only ever see token ids: stop strings are the router's job.

Only stdlib and `tokenizers` here: the router must not import torch or vllm.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

# Prompt tokens kept as left context for the first generated tokens (vLLM uses the same number):
# decoders such as SentencePiece's strip the leading space of the first token they see.
_CONTEXT_TOKENS = 5
_UTF8 = codecs.getincrementaldecoder("utf-8")  # looked up once, not per request


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as a plain string or as a serialised
    # AddedToken ({"content": ..., "lstrip": ...}).
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_ids(value: Any) -> list[int]:
    # config.json / generation_config.json: eos_token_id is an int, a list of ints, or absent.
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    # Newer Hugging Face checkpoints keep the template in its own file; older ones inline it in
    # tokenizer_config.json, either as a string or as a list of named templates.
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tmpl = config.get("chat_template")
    if isinstance(tmpl, str):
        return tmpl
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


class RouterTokenizer:
    """A Hugging Face tokenizer loaded with plain `tokenizers` (no transformers, no torch)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = Tokenizer.from_file(str(tok_file))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        self._bos_token = _token_str(tok_config.get("bos_token"))
        self._eos_token = _token_str(tok_config.get("eos_token"))
        self._chat_template = _chat_template(model_dir, tok_config)
        self._special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        # EOS can be declared in three places and models disagree on which; vLLM stops on the
        # union (generation_config's list often adds e.g. an end-of-turn token).
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos.update(_as_ids(_read_json(model_dir / name).get("eos_token_id")))
        if self._eos_token is not None:
            eos_id = self._tok.token_to_id(self._eos_token)
            if eos_id is not None:
                eos.add(eos_id)
        self._eos_ids = frozenset(eos)
        table = _byte_level_table(self._tok)
        # Per skip_special_tokens: a special token skipped is a token with no bytes.
        self._id_bytes = None if table is None else {
            False: table, True: tuple(b"" if i in self._special_ids else b
                                      for i, b in enumerate(table))}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the post-processor adds BOS etc. as the engine would."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def raw(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for incremental decoding)."""
        return self._tok

    def id_bytes(self, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
        """Each id's bytes when decoding is byte-level (see `_byte_level_table`), else None."""
        return None if self._id_bytes is None else self._id_bytes[skip_special_tokens]


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): bytes that print as
    themselves keep their code point, the others are moved to 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(moved)}}


def _byte_level_table(tok: Tokenizer) -> tuple[bytes, ...] | None:
    """Each token id's bytes, when the tokenizer decodes byte-level (GPT-2, Llama 3, Qwen,
    SmolLM): decoding ids is then decoding their bytes, concatenated, as UTF-8 (invalid bytes
    replaced), so a stream needs no tokenizer call per token -- DecodeStream costs ~8 µs a
    token, the largest share of the router's own per-token work. A token with a character
    outside the byte alphabet (an added token's plain text) stands for its UTF-8, as the
    decoder does. None for other decoders, or if the table and the tokenizer disagree on any
    single id (checked for every id, once, at start-up)."""
    if not isinstance(tok.decoder, ByteLevel):
        return None
    alphabet = _byte_alphabet()
    n = tok.get_vocab_size(with_added_tokens=True)
    table = []
    for i in range(n):
        piece = tok.id_to_token(i) or ""
        try:
            table.append(bytes(alphabet[c] for c in piece))
        except KeyError:
            table.append(piece.encode())
    decoded = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    if any(b.decode(errors="replace") != d for b, d in zip(table, decoded)):
        return None
    return tuple(table)


class IncrementalDetokenizer:
    """Streams text for generated token ids without splitting a UTF-8 character.

    Byte-level tokenizers (`RouterTokenizer.id_bytes`): each id's bytes go through an
    incremental UTF-8 decoder, which holds back an unfinished character and replaces invalid
    bytes as the tokenizer's own decode does. Other tokenizers use tokenizers' `DecodeStream`
    (one Rust call per token, keeping a small window of left context: SentencePiece decoders
    depend on neighbouring tokens).
    It returns nothing while a character's bytes are incomplete; the tokens it holds back are
    remembered so that `flush()` can give out what they decode to when generation ends there
    (a truly invalid byte sequence). Without `prompt_ids` the concatenated deltas plus `flush()`
    equal `decode(all ids)`. With them, the last few prompt tokens serve as left context (a
    leading space survives decoders that strip it at the start of text) and are never emitted.
    """

    def __init__(self, tokenizer: RouterTokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._raw = tokenizer.raw
        self._skip = skip_special_tokens
        self._held: list[int] = []  # pushed since the stream last gave text
        self.num_tokens = 0  # generated tokens pushed so far
        self._bytes = tokenizer.id_bytes(skip_special_tokens)
        if self._bytes is not None:
            self._utf8 = _UTF8(errors="replace")
            return
        context = [int(i) for i in prompt_ids[-_CONTEXT_TOKENS:]] if prompt_ids else None
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated token ids; return the text that became final with them."""
        self.num_tokens += len(ids)
        table = self._bytes
        if table is not None:
            try:
                data = b"".join([table[i] for i in ids])
            except IndexError:  # an id past the tokenizer's vocabulary (a padded embedding)
                data = b"".join([table[i] for i in ids if 0 <= i < len(table)])
            return self._utf8.decode(data)
        out: list[str] = []
        step, raw, held = self._stream.step, self._raw, self._held
        for i in ids:
            i = int(i)
            piece = step(raw, i)
            if piece is None:
                held.append(i)
            else:
                held.clear()
                out.append(piece)
        return "".join(out)

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. a truly invalid byte sequence)."""
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        held, self._held = self._held, []
        return self._raw.decode(held, skip_special_tokens=self._skip) if held else ""


class StopMatcher:
    """Finds stop strings in streamed text and cuts the output before the first one.

    Text that could still turn out to be the start of a stop string (the longest suffix that is a
    proper prefix of some stop string, so at most `max(len(stop)) - 1` characters) is held back
    until the next delta resolves it. When several stop strings occur, the one whose last
    character comes first wins (ties: the one starting first), which is exactly what token-by-token
    streaming sees, so the result does not depend on how the text was chunked.

    Linear in the text and in the stop strings' total length: an Aho-Corasick automaton whose state
    is that longest suffix, so the held-back length is the state's depth. (Rescanning every suffix
    against a set of every prefix cost the square of a stop string's length per token, in time and
    memory, on the router's only event loop.)
    """

    def __init__(self, stop: Iterable[str] = ()) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._auto = _StopAutomaton(self._stops) if self._stops else None
        self._state = 0
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Return (text safe to emit now, matched stop string or None)."""
        if self.matched is not None:
            return "", self.matched
        auto = self._auto
        if auto is None:
            return delta, None
        buf = self._held + delta
        state, step, depth, out = self._state, auto.step, auto.depth, auto.out
        for i in range(len(buf) - len(delta), len(buf)):
            state = step(state, buf[i])
            if out[state] is not None:
                self._held, self._state = "", 0
                self.matched = out[state]
                return buf[: i + 1 - len(self.matched)], self.matched
        self._state = state
        hold = depth[state]
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Held-back text, released at the end of generation (empty after a match)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


class _StopAutomaton:
    """Aho-Corasick over the stop strings. State 0 is the root; `depth[s]` is the length of the
    prefix state s stands for; `out[s]` the longest stop string ending at s (itself or through
    its failure chain), else None — the longest is the one that started first."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        out: list[str | None] = [None]
        for s in stops:
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    out.append(None)
                node = nxt
            out[node] = s
        self.fail = [0] * len(self.goto)
        order = list(self.goto[0].values())  # breadth first: a node's failure is shallower
        for node in order:
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0)
                if out[child] is None:
                    out[child] = out[self.fail[child]]
                order.append(child)
        self.out = out

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)
