"""Workloads: length distributions, synthetic prompts, mixtures and ShareGPT parsing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.workload import LengthDist, RequestSpec, mixture, sharegpt, synthetic


def _draw(d: str, n: int = 20_000, seed: int = 0) -> np.ndarray:
    return LengthDist.parse(d).sample_n(np.random.default_rng(seed), n)


def test_request_spec() -> None:
    assert RequestSpec((1, 2, 3), None, 5).prompt_len == 3
    assert RequestSpec(None, "hi", 5).prompt_len == -1
    for bad in ((None, None, 1), ((1,), "x", 1), ((1,), None, 0)):
        with pytest.raises(ValueError):
            RequestSpec(*bad)


def test_fixed_is_exact() -> None:
    d = LengthDist.parse("fixed:128")
    rng = np.random.default_rng(0)
    assert {d.sample(rng) for _ in range(50)} == {128}
    assert d.mean() == 128.0
    assert LengthDist.parse("fixed:128@1-100").mean() == 100.0


def test_uniform_bounds_inclusive() -> None:
    x = _draw("uniform:3-7")
    assert set(np.unique(x).tolist()) == {3, 4, 5, 6, 7}
    assert x.mean() == pytest.approx(5.0, rel=0.02)
    assert LengthDist.parse("uniform:3-7").mean() == 5.0
    # clipping to [4, 5]: values 3,4 -> 4 and 5,6,7 -> 5, mean (4+4+5+5+5)/5
    assert LengthDist.parse("uniform:3-7@4-5").mean() == pytest.approx(4.6)
    assert set(np.unique(_draw("uniform:3-7@4-5")).tolist()) == {4, 5}


def test_lognormal_median_mean_and_clipping() -> None:
    x = _draw("lognormal:200,0.8")
    assert np.median(x) == pytest.approx(200, rel=0.03)
    d = LengthDist.parse("lognormal:200,0.8")
    assert d.mean() == pytest.approx(200 * np.exp(0.8**2 / 2), rel=0.01)
    assert x.mean() == pytest.approx(d.mean(), rel=0.03)
    clipped = LengthDist.parse("lognormal:200,0.8@16-300")
    y = clipped.sample_n(np.random.default_rng(1), 20_000)
    assert y.min() >= 16 and y.max() <= 300 and (y == 300).any()
    assert y.mean() == pytest.approx(clipped.mean(), rel=0.02)
    assert LengthDist.parse("lognormal:50,0").mean() == 50.0
    assert set(_draw("lognormal:50,0", 100).tolist()) == {50}


def test_samples_are_at_least_one() -> None:
    x = _draw("lognormal:1,3")
    assert x.min() >= 1
    assert isinstance(LengthDist.parse("lognormal:1,3").sample(np.random.default_rng(0)), int)


@pytest.mark.parametrize(
    "s",
    ["", "fixed", "fixed:0", "fixed:-3", "fixed:1.5", "uniform:5", "uniform:9-3", "uniform:0-3",
     "lognormal:200", "lognormal:0,1", "lognormal:200,-1", "normal:5,1", "fixed:5@10-2",
     "fixed:5@0-10", "fixed:5@10", "fixed:5 extra"],
)
def test_parse_errors(s: str) -> None:
    with pytest.raises(ValueError):
        LengthDist.parse(s)


def test_parse_round_trip() -> None:
    for s in ("fixed:7", "uniform:1-9", "lognormal:200,0.8@16-2048", " fixed : 7 "):
        d = LengthDist.parse(s)
        assert LengthDist.parse(str(d)) == d


@settings(max_examples=40, deadline=None)
@given(
    a=st.integers(1, 500), width=st.integers(0, 500), lo=st.integers(1, 300),
    span=st.integers(0, 300), seed=st.integers(0, 1000),
)
def test_uniform_clip_property(a: int, width: int, lo: int, span: int, seed: int) -> None:
    d = LengthDist.parse(f"uniform:{a}-{a + width}@{lo}-{lo + span}")
    x = d.sample_n(np.random.default_rng(seed), 200)
    assert x.min() >= lo and x.max() <= lo + span
    # the analytic mean equals the exact average over the (equally likely) support
    support = np.clip(np.arange(a, a + width + 1), lo, lo + span)
    assert d.mean() == pytest.approx(support.mean())


def test_synthetic_deterministic_and_lengths() -> None:
    args = (50, "uniform:5-20", "fixed:9", 1000, 3)
    a, b = synthetic(*args), synthetic(*args)
    assert a == b and synthetic(50, "uniform:5-20", "fixed:9", 1000, 4) != a
    assert len(a) == 50
    assert all(5 <= r.prompt_len <= 20 and r.output_len == 9 and r.group is None for r in a)
    assert all(r.prompt_text is None and all(0 <= t < 1000 for t in r.prompt_ids) for r in a)


def test_excluded_ids_never_appear() -> None:
    reqs = synthetic(200, LengthDist.parse("fixed:50"), LengthDist.parse("fixed:1"), 8, 0,
                     exclude_ids=(0, 2, 7), shared_prefix_len=10, num_groups=3)
    seen = Counter(t for r in reqs for t in r.prompt_ids)
    assert set(seen) == {1, 3, 4, 5, 6}
    with pytest.raises(ValueError):
        synthetic(1, "fixed:5", "fixed:1", 3, 0, exclude_ids=(0, 1, 2))


def test_shared_prefix_groups() -> None:
    p = 32
    reqs = synthetic(40, "uniform:1-100", "fixed:4", 50_000, 11, shared_prefix_len=p,
                     num_groups=4)
    assert [r.group for r in reqs[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    prefixes = {}
    for r in reqs:
        assert r.prompt_len >= p + 1
        prefixes.setdefault(r.group, set()).add(r.prompt_ids[:p])
    assert all(len(s) == 1 for s in prefixes.values())
    assert len({next(iter(s)) for s in prefixes.values()}) == 4  # groups differ
    # the parts after the prefix are each request's own
    assert len({r.prompt_ids[p:] for r in reqs}) == len(reqs)
    for bad in ({"shared_prefix_len": 8}, {"num_groups": 2}):
        with pytest.raises(ValueError):
            synthetic(4, "fixed:20", "fixed:1", 100, 0, **bad)


def test_mixture_weights_and_determinism() -> None:
    long = synthetic(100, "fixed:2000", "fixed:10", 100, 1)
    chat = synthetic(400, "fixed:100", "fixed:10", 100, 2)
    m = mixture([(0.2, long), (0.8, chat)], seed=5, n=100)
    assert len(m) == 100
    assert sum(r.prompt_len == 2000 for r in m) == 20
    assert m == mixture([(0.2, long), (0.8, chat)], seed=5, n=100)
    assert m != mixture([(0.2, long), (0.8, chat)], seed=6, n=100)
    assert m[:20] != [r for r in m if r.prompt_len == 2000]  # interleaved, not concatenated
    # default n: as many as the classes support at these proportions (chat limits: 400/0.8)
    assert len(mixture([(0.2, long), (0.8, chat)], seed=0)) == 500
    # largest-remainder rounding keeps the total exact
    odd = mixture([(1, long), (1, chat), (1, chat)], seed=0, n=10)
    assert len(odd) == 10
    with pytest.raises(ValueError):
        mixture([(0.5, long[:3]), (0.5, chat)], seed=0, n=100)
    for bad in ([], [(-1.0, long)], [(0.0, long)]):
        with pytest.raises(ValueError):
            mixture(bad, seed=0, n=1)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 300), frac=st.floats(0.0, 1.0))
def test_mixture_keeps_lists_sized_in_proportion(total: int, frac: float) -> None:
    # how a caller sizes the classes: round() for one, the rest for the other
    n_long = round(total * frac)
    long = synthetic(n_long, "fixed:3", "fixed:1", 10, 0)
    chat = synthetic(total - n_long, "fixed:2", "fixed:1", 10, 1)
    m = mixture([(1 - frac, chat), (frac, long)], seed=0)
    assert sorted(m, key=lambda r: r.prompt_ids) == sorted(long + chat, key=lambda r: r.prompt_ids)


def _words(s: str) -> list[int]:
    return [len(w) for w in s.split()]


def _conv(human: str, gpt: str, i: int) -> dict:
    return {"id": str(i), "conversations": [{"from": "human", "value": human},
                                            {"from": "gpt", "value": gpt}]}


def _write_sharegpt(tmp_path: Path) -> Path:
    good = [_conv(" ".join(["q"] * (5 + i)), " ".join(["a"] * (10 + i)), i) for i in range(6)]
    junk = [
        "not a dict",
        {"id": "x"},
        {"id": "y", "conversations": "nope"},
        {"id": "z", "conversations": [{"from": "gpt", "value": "reply only here ok"}]},
        {"id": "w", "conversations": [{"from": "human", "value": 5}, {"from": "gpt"}]},
        _conv("too short", "a b c d e", 90),  # 2-token prompt < min_len
        _conv("p " * 10, "a b", 91),  # 2-token reply < min_len
        _conv("p " * 10, "a " * 100, 92),  # reply > max_output
        _conv("w " * 300, "a " * 10, 93),  # prompt > max_input
    ]
    # system turn first and a second exchange: the first human turn and the gpt reply after it
    sys_first = {"id": "s", "conversations": [
        {"from": "system", "value": "ignore me"}, {"from": "human", "value": "one two three four"},
        {"from": "gpt", "value": "r r r r r r r"}, {"from": "human", "value": "x"}]}
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(good + junk + [sys_first]))
    return path


def test_sharegpt_parsing(tmp_path: Path) -> None:
    path = _write_sharegpt(tmp_path)
    kw = {"max_input": 100, "max_output": 50}
    reqs = sharegpt(path, 7, _words, seed=0, **kw)
    assert len(reqs) == 7
    assert all(r.prompt_text is None and r.group is None for r in reqs)
    pairs = sorted((r.prompt_len, r.output_len) for r in reqs)
    assert pairs == [(4, 7)] + [(5 + i, 10 + i) for i in range(6)]
    assert all(set(r.prompt_ids) == {3, 4, 5} or set(r.prompt_ids) == {1} for r in reqs)
    again = sharegpt(path, 7, _words, seed=0, **kw)
    assert again == reqs
    sub = sharegpt(path, 3, _words, seed=1, **kw)
    assert len(sub) == 3 and set(sub) <= set(reqs)
    orders = {tuple(r.prompt_len for r in sharegpt(path, 7, _words, seed=s, **kw))
              for s in range(5)}
    assert len(orders) > 1  # the seed shuffles
    with pytest.raises(ValueError, match="only 7 usable"):
        sharegpt(path, 8, _words, seed=0, **kw)
    # relaxed limits admit the long ones
    assert len(sharegpt(path, 9, _words, seed=0, max_input=1000, max_output=1000)) == 9


def test_sharegpt_not_a_list(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError):
        sharegpt(path, 1, _words, seed=0)
