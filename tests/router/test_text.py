"""RouterTokenizer, IncrementalDetokenizer and StopMatcher on the project's tiny model tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from router.text import IncrementalDetokenizer, RouterTokenizer, StopMatcher
from splitserve.tiny_tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN

MULTIBYTE = "日本語 🚀 👍🏽 café"
# Characters the tokenizer never saw whole: they encode as several byte tokens each.
RARE = "ꙮ𓀀🦀ǅ𝔘"

_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module", params=["bytes", "stream"])
def tok(request: pytest.FixtureRequest, tiny_model_dir: Path) -> RouterTokenizer:
    """The tiny model's tokenizer through each detokenisation path: its own byte table
    (byte-level BPE), and tokenizers' DecodeStream (what other tokenizers get)."""
    t = RouterTokenizer(tiny_model_dir)
    assert t.id_bytes(skip_special_tokens=True) is not None, "the tiny tokenizer is byte-level"
    if request.param == "stream":
        t._id_bytes = None
    return t


def stream(tok: RouterTokenizer, ids: list[int], sizes: list[int], skip: bool = True) -> list[str]:
    """Deltas from pushing `ids` in chunks of the given sizes (cycled), then the flush."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        deltas.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(detok.flush())
    assert detok.num_tokens == len(ids)
    return deltas


def check_stream(tok: RouterTokenizer, ids: list[int], sizes: list[int], skip: bool) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    deltas = stream(tok, ids, sizes, skip)
    assert "".join(deltas) == full
    pos = 0
    for d in deltas:
        # Text is never retracted, so a U+FFFD emitted early must be one the full decode has.
        for j, ch in enumerate(d):
            if ch == "\ufffd":
                assert full[pos + j] == "\ufffd"
        pos += len(d)


# --- RouterTokenizer ------------------------------------------------------------------------


def test_tokenizer_metadata(tok: RouterTokenizer, tiny_model_dir: Path) -> None:
    assert tok.bos_token == BOS_TOKEN
    assert tok.eos_token == EOS_TOKEN
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token_ids == frozenset({1})
    assert tok.special_ids == frozenset({0, 1, 2})
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert tok.vocab_size == cfg["vocab_size"]


def test_encode_adds_bos_and_roundtrips(tok: RouterTokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    assert ids[0] == 0  # BOS from the post-processor
    assert 0 not in tok.encode(MULTIBYTE, add_special_tokens=False)
    assert tok.decode(ids) == MULTIBYTE
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + MULTIBYTE


def test_eos_ids_union_of_configs(tmp_path: Path, tiny_model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert RouterTokenizer(tmp_path).eos_token_ids == frozenset({1, 7, 9})


def test_config_variants(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    cfg = {
        "bos_token": {"content": BOS_TOKEN, "lstrip": False},
        "eos_token": {"content": EOS_TOKEN},
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = RouterTokenizer(tmp_path)
    assert (t.bos_token, t.eos_token, t.chat_template) == (BOS_TOKEN, EOS_TOKEN, "D")
    assert t.eos_token_ids == frozenset({1})  # from the eos token string alone
    (tmp_path / "chat_template.jinja").write_text("J")
    assert RouterTokenizer(tmp_path).chat_template == "J"


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        RouterTokenizer(tmp_path)


# --- IncrementalDetokenizer -----------------------------------------------------------------


def test_multibyte_one_token_at_a_time(tok: RouterTokenizer) -> None:
    text = MULTIBYTE + " " + RARE
    ids = tok.encode(text)
    deltas = stream(tok, ids, [1])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The rare characters span several tokens, so some pushes must have held text back.
    assert len(ids) > len(text.split()) + 4 and "" in deltas[:-1]


def test_character_split_across_tokens_is_held_back(tok: RouterTokenizer) -> None:
    ids = tok.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1, "needs a character that spans tokens"
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🦀"
    assert detok.flush() == ""


def test_special_tokens(tok: RouterTokenizer) -> None:
    ids = [0, *tok.encode("ab", add_special_tokens=False), 1]
    assert "".join(stream(tok, ids, [1])) == "ab"
    assert "".join(stream(tok, ids, [1], skip=False)) == f"{BOS_TOKEN}ab{EOS_TOKEN}"


def test_invalid_bytes_flushed_at_end(tok: RouterTokenizer) -> None:
    # The first token of a multi-token character alone is an incomplete sequence forever.
    first = tok.encode("🦀", add_special_tokens=False)[0]
    ids = tok.encode("x", add_special_tokens=False) + [first]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == "x"
    assert detok.flush() == tok.decode(ids)[1:] == "\ufffd"


def test_prompt_context_not_emitted(tok: RouterTokenizer) -> None:
    prompt = tok.encode("hello world")
    out = tok.encode(" café 🦀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.push([i]) for i in out) + detok.flush()
    assert text == " café 🦀"
    assert detok.num_tokens == len(out)


def test_window_stays_small(tok: RouterTokenizer) -> None:
    ids = tok.encode("the model " * 300, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.push([i])
        assert len(detok._held) <= 4  # only an unfinished character is held back


@_SETTINGS
@given(text=st.text(max_size=40), sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_property_text(tok: RouterTokenizer, text: str, sizes: list[int]) -> None:
    # A special token's spelling ("<|pad|>") encodes to that token, which decoding skips.
    assume(not any(tok.raw.id_to_token(i) in text for i in tok.special_ids))
    ids = tok.encode(text)
    check_stream(tok, ids, [1], skip=True)
    check_stream(tok, ids, sizes, skip=True)
    assert "".join(stream(tok, ids, [1])) == text
    for d in stream(tok, ids, sizes):
        assert "\ufffd" not in d or "\ufffd" in text


@_SETTINGS
@given(
    ids=st.lists(st.integers(0, 4095), max_size=30),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    skip=st.booleans(),
)
def test_property_random_ids(
    tok: RouterTokenizer, ids: list[int], sizes: list[int], skip: bool
) -> None:
    ids = [i % tok.vocab_size for i in ids]
    check_stream(tok, ids, [1], skip)
    check_stream(tok, ids, sizes, skip)


@_SETTINGS
@given(data=st.data())
def test_property_emitted_prefix_is_stable(tok: RouterTokenizer, data: st.DataObject) -> None:
    # After every push, what was emitted is a prefix of what the ids so far decode to: nothing
    # is emitted that a later token could change.
    ids = data.draw(st.lists(st.integers(3, tok.vocab_size - 1), max_size=25))
    detok = IncrementalDetokenizer(tok)
    emitted = ""
    for n, i in enumerate(ids, 1):
        emitted += detok.push([i])
        assert tok.decode(ids[:n]).startswith(emitted)


# --- StopMatcher ----------------------------------------------------------------------------


def feed_all(m: StopMatcher, deltas: list[str]) -> tuple[str, str | None]:
    out, matched = "", None
    for d in deltas:
        text, matched = m.feed(d)
        out += text
    return out + m.flush(), matched


def test_no_stops_pass_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", None)
    assert m.feed("") == ("", None)
    assert m.flush() == ""


def test_stop_split_across_many_deltas() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", None)
    assert m.feed("T") == ("", None)
    assert m.feed("O") == ("", None)
    assert m.feed("P and more") == ("", "STOP")
    assert m.feed("ignored") == ("", "STOP")
    assert m.flush() == ""


def test_false_start_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", None)
    assert m.feed("x") == ("STx", None)
    assert m.feed("STO") == ("", None)
    assert m.flush() == "STO"


def test_stop_at_very_start() -> None:
    assert StopMatcher(["<"]).feed("<end") == ("", "<")
    m = StopMatcher(["###"])
    assert m.feed("#") == ("", None)
    assert m.feed("##tail") == ("", "###")


def test_multiple_stops_first_to_complete_wins() -> None:
    m = StopMatcher(["world", "lo"])
    assert feed_all(m, ["hello world"]) == ("hel", "lo")
    assert feed_all(StopMatcher(["b", "abc"]), ["xabc"]) == ("xa", "b")
    # Same end: the longer (earlier starting) one wins.
    assert feed_all(StopMatcher(["c", "abc"]), ["xabc"]) == ("x", "abc")


def test_overlapping_prefixes() -> None:
    # "aab" inside "aaab": a naive matcher that restarts after a mismatch misses it.
    assert feed_all(StopMatcher(["aab"]), list("xaaab")) == ("xa", "aab")
    assert feed_all(StopMatcher(["abab"]), list("abaabab!")) == ("aba", "abab")
    # Only a possible stop-string start is held back, not max_len - 1 characters blindly.
    m = StopMatcher(["abcdef"])
    assert m.feed("xyz") == ("xyz", None)
    assert m.feed("xab") == ("x", None)


def test_no_match_flushes_everything() -> None:
    assert feed_all(StopMatcher(["zz", "q!"]), ["a z", "b q", ""]) == ("a zb q", None)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_property_stop_chunking_invariant(text: str, stops: list[str], cuts: list[int]) -> None:
    # Reference: feed one character at a time, cut at the first stop to complete.
    expect_text, expect_stop = text, None
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            expect_stop = max(hits, key=len)
            expect_text = text[: end - len(expect_stop)]
            break
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert feed_all(StopMatcher(stops), chunks) == (expect_text, expect_stop)


def test_long_stop_strings_cost_linear_memory_and_match_across_deltas() -> None:
    # A 20,000-character stop string used to cost ~200 MB (every prefix stored) and a quadratic
    # rescan per token on the router's event loop; the automaton has one state per character.
    stop = "ab" * 10_000
    m = StopMatcher([stop, "zz"])
    assert len(m._auto.depth) == len(stop) + 3  # root + one state per stop-string character
    text = "x" + "ab" * 9_999 + "a"  # one character short of the stop string
    out = "".join(m.feed(text[i:i + 7])[0] for i in range(0, len(text), 7))
    assert out == "x" and m.feed("b!") == ("", stop)
    m = StopMatcher([stop])
    assert feed_all(m, [text, "c"]) == (text + "c", None)


def test_byte_table_only_for_byte_level_decoders(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordLevel({"[UNK]": 0, "ab": 1, "##c": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    t = RouterTokenizer(tmp_path)
    assert t.id_bytes(skip_special_tokens=True) is None  # WordPiece joins "##" pieces
    detok = IncrementalDetokenizer(t)
    assert detok.push([1]) + detok.push([2]) + detok.flush() == t.decode([1, 2]) == "abc"
