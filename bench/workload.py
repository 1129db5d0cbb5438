"""Request workloads for the load tester: what each request asks for, not when it is sent.

A workload is a list of `RequestSpec`. Three sources:
  synthetic   random token ids with lengths drawn from a `LengthDist`, optionally grouped so that
              each group shares a prompt prefix (exercises prefix caching / KV reuse);
  sharegpt    the ShareGPT JSON that vLLM's benchmark_serving.py uses (real prompt/reply lengths);
  mixture     several workloads interleaved by weight (e.g. 20% long prompts + 80% chat).
Everything is deterministic for a given seed so that runs at different rates see the same requests.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request. Exactly one of prompt_ids / prompt_text is set; ids keep lengths known."""

    prompt_ids: tuple[int, ...] | None
    prompt_text: str | None
    output_len: int
    group: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt_ids is None) == (self.prompt_text is None):
            raise ValueError("exactly one of prompt_ids / prompt_text must be set")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens, or -1 for a text prompt (that depends on the tokenizer)."""
        return len(self.prompt_ids) if self.prompt_ids is not None else -1


_INT = r"(\d+)"
_NUM = r"(\d+(?:\.\d*)?|\.\d+)"
_SPEC = re.compile(r"^\s*(\w+)\s*:\s*([^@]*?)\s*(?:@\s*" + _INT + r"\s*-\s*" + _INT + r")?\s*$")
_BODIES = {
    "fixed": re.compile(r"^" + _INT + r"$"),
    "uniform": re.compile(r"^" + _INT + r"\s*-\s*" + _INT + r"$"),
    "lognormal": re.compile(r"^" + _NUM + r"\s*,\s*" + _NUM + r"$"),
}
_FORMS = "'fixed:N', 'uniform:A-B' or 'lognormal:MEDIAN,SIGMA', optionally followed by '@MIN-MAX'"


def _phi(x: float) -> float:
    """Standard normal CDF (math.erf keeps this free of scipy; erf(+-inf) is +-1)."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts. Samples are whole numbers clipped to [lo, hi], and lo is
    never below 1, so a request always has at least one prompt / output token.

    kind 'fixed' uses a; 'uniform' draws integers in [a, b] inclusive; 'lognormal' has median a
    and b the sigma of the underlying normal (so ln(X) ~ N(ln a, b^2)), rounded to the nearest int.
    """

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _BODIES:
            raise ValueError(f"unknown length distribution {self.kind!r}; expected {_FORMS}")
        if self.lo < 1 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"bad clip range {self.lo}-{self.hi}: need 1 <= MIN <= MAX")
        if self.kind == "fixed" and (self.a < 1 or self.a != int(self.a)):
            raise ValueError(f"fixed length must be an integer >= 1, got {self.a}")
        if self.kind == "uniform" and not (1 <= self.a <= self.b):
            raise ValueError(f"uniform range needs 1 <= A <= B, got {self.a}-{self.b}")
        if self.kind == "lognormal" and not (self.a > 0 and math.isfinite(self.b) and self.b >= 0):
            raise ValueError(f"lognormal needs MEDIAN > 0 and SIGMA >= 0, got {self.a},{self.b}")

    @classmethod
    def parse(cls, s: str) -> LengthDist:
        """Parse e.g. 'fixed:128', 'uniform:32-512', 'lognormal:200,0.8@16-2048'."""
        m = _SPEC.match(s) if isinstance(s, str) else None
        body = _BODIES.get(m.group(1).lower()) if m else None
        bm = body.match(m.group(2)) if body else None
        if m is None or bm is None:
            raise ValueError(f"bad length distribution {s!r}; expected {_FORMS}")
        kind = m.group(1).lower()
        nums = [float(g) for g in bm.groups()]
        lo = int(m.group(3)) if m.group(3) is not None else 1
        hi = int(m.group(4)) if m.group(4) is not None else None
        try:
            return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0, lo, hi)
        except ValueError as e:
            raise ValueError(f"bad length distribution {s!r}: {e}") from None

    def __str__(self) -> str:
        a, b = int(self.a), int(self.b)
        body = {"fixed": f"{a}", "uniform": f"{a}-{b}", "lognormal": f"{self.a:g},{self.b:g}"}
        clip = "" if self.lo == 1 and self.hi is None else f"@{self.lo}-{self.hi}"
        return f"{self.kind}:{body[self.kind]}{clip}"

    def _clip(self, x: np.ndarray) -> np.ndarray:
        return np.clip(x, self.lo, self.hi if self.hi is not None else None)

    def sample_n(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n samples as an int64 array (vectorised; one call consumes the rng like n samples)."""
        if self.kind == "fixed":
            raw = np.full(n, int(self.a), dtype=np.int64)
        elif self.kind == "uniform":
            raw = rng.integers(int(self.a), int(self.b) + 1, size=n, dtype=np.int64)
        else:
            x = rng.lognormal(mean=math.log(self.a), sigma=self.b, size=n)
            raw = np.floor(x + 0.5).astype(np.int64)
        return self._clip(raw).astype(np.int64)

    def sample(self, rng: np.random.Generator) -> int:
        return int(self.sample_n(rng, 1)[0])

    def mean(self) -> float:
        """Analytic mean after clipping. For lognormal, rounding to whole tokens is ignored (the
        exact expectation differs by less than half a token)."""
        lo, hi = self.lo, self.hi if self.hi is not None else math.inf
        if self.kind == "fixed":
            return float(min(max(int(self.a), lo), hi))
        if self.kind == "uniform":  # exact: the average of the clipped, equally likely support
            return float(np.clip(np.arange(int(self.a), int(self.b) + 1), lo, hi).mean())
        mu, s = math.log(self.a), self.b
        if s == 0:
            return float(min(max(math.floor(self.a + 0.5), lo), hi))
        z_lo = (math.log(lo) - mu) / s
        z_hi = (math.log(hi) - mu) / s
        partial = math.exp(mu + s * s / 2) * (_phi(z_hi - s) - _phi(z_lo - s))
        upper = hi * (1.0 - _phi(z_hi)) if hi != math.inf else 0.0
        return lo * _phi(z_lo) + partial + upper


def _as_dist(d: LengthDist | str) -> LengthDist:
    return d if isinstance(d, LengthDist) else LengthDist.parse(d)


def synthetic(
    n: int,
    input_len: LengthDist | str,
    output_len: LengthDist | str,
    vocab_size: int,
    seed: int,
    *,
    exclude_ids: Sequence[int] = (),
    shared_prefix_len: int = 0,
    num_groups: int = 0,
) -> list[RequestSpec]:
    """n requests of random token ids, uniform over [0, vocab_size) minus exclude_ids (special
    tokens: a stray EOS or BOS in a prompt changes what the server does).

    With num_groups > 0 and shared_prefix_len > 0, request i belongs to group i % num_groups and
    starts with that group's shared_prefix_len tokens; its length is then
    max(sampled, shared_prefix_len + 1) so that every prompt has at least one token of its own.
    """
    input_len, output_len = _as_dist(input_len), _as_dist(output_len)
    if n < 0 or shared_prefix_len < 0 or num_groups < 0:
        raise ValueError("n, shared_prefix_len and num_groups must be >= 0")
    if (shared_prefix_len > 0) != (num_groups > 0):
        raise ValueError("shared_prefix_len and num_groups must both be > 0 (or both 0)")
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(exclude_ids, int))
    if allowed.size == 0:
        raise ValueError(f"no token ids left: vocab_size={vocab_size}, exclude_ids={exclude_ids}")

    rng = np.random.default_rng(seed)
    p = shared_prefix_len
    in_lens = np.maximum(input_len.sample_n(rng, n), p + 1)
    out_lens = output_len.sample_n(rng, n).tolist()
    prefix_ids = allowed[rng.integers(0, allowed.size, size=(num_groups, p))].tolist()
    prefixes = [tuple(row) for row in prefix_ids]
    own = (in_lens - p).tolist()
    # One draw for all prompt tokens, split afterwards: far faster than n small draws.
    tokens = allowed[rng.integers(0, allowed.size, size=sum(own))].tolist()

    out: list[RequestSpec] = []
    pos = 0
    for i, k in enumerate(own):
        group = i % num_groups if num_groups else None
        head = prefixes[group] if group is not None else ()
        out.append(RequestSpec(head + tuple(tokens[pos : pos + k]), None, out_lens[i], group))
        pos += k
    return out


def _shares(p: np.ndarray, n: int, avail: list[int]) -> list[int]:
    """Split n by p, largest remainder first. Remainders are rounded so float noise cannot pick
    the winner; ties go to the class with more to spare, so lists sized in proportion fit."""
    exact = p * n
    base = np.floor(exact + 1e-9).astype(int)
    rem = np.round(exact - base, 9)
    order = sorted((i for i in range(len(p)) if p[i] > 0),
                   key=lambda i: (-rem[i], -(avail[i] - base[i]), i))
    for i in order[: max(0, n - int(base.sum()))]:
        base[i] += 1
    return base.tolist()


def mixture(
    classes: list[tuple[float, list[RequestSpec]]], seed: int, *, n: int | None = None
) -> list[RequestSpec]:
    """Interleave workloads by weight, e.g. [(0.2, long_prompts), (0.8, chat)].

    Class i contributes n * w_i / sum(w) requests (largest remainder rounding), taken from the
    front of its list; the result is shuffled with seed. The default n is the largest, up to all
    the requests given, that the classes can supply at these proportions: lists already sized in
    proportion come back whole.
    """
    if not classes:
        raise ValueError("mixture needs at least one class")
    weights = np.array([float(w) for w, _ in classes])
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights.tolist()}")
    p = weights / weights.sum()
    avail = [len(reqs) for _, reqs in classes]
    if n is None:
        # A share is at least floor(n * p_i), so n * p_i < avail_i + 1 bounds the search.
        n = sum(avail)
        for a, pi in zip(avail, p):
            n = math.floor((a + 1) / pi) if pi * n > a + 1 else n
        while n > 0 and any(c > a for c, a in zip(_shares(p, n, avail), avail)):
            n -= 1
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    picked: list[RequestSpec] = []
    for c, (w, reqs) in zip(_shares(p, n, avail), classes):
        if c > len(reqs):
            raise ValueError(f"class with weight {w} needs {c} requests, has {len(reqs)}")
        picked.extend(reqs[:c])
    order = np.random.default_rng(seed).permutation(len(picked))
    return [picked[i] for i in order]


def _first_exchange(entry: object) -> tuple[str, str] | None:
    """(first human turn, first gpt reply after it), or None if the entry is malformed."""
    if not isinstance(entry, dict):
        return None
    conv = entry.get("conversations")
    if not isinstance(conv, list):
        return None
    prompt = None
    for turn in conv:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        if prompt is None and turn.get("from") == "human":
            prompt = turn["value"]
        elif prompt is not None and turn.get("from") == "gpt":
            return prompt, turn["value"]
    return None


def sharegpt(
    path: str | Path,
    n: int,
    encode: Callable[[str], list[int]],
    seed: int,
    *,
    max_input: int = 4096,
    max_output: int = 2048,
    min_len: int = 4,
) -> list[RequestSpec]:
    """n requests from a ShareGPT JSON list of {"id", "conversations": [{"from", "value"}]}.

    The prompt is the first human turn (encoded, so its length is known) and output_len is the
    encoded length of the first gpt reply after it. Entries that are malformed, shorter than
    min_len on either side, or longer than max_input / max_output are skipped. Entries are visited
    in a seed-shuffled order and encoded lazily, so a small n over a big file stays cheap.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    out: list[RequestSpec] = []
    for i in np.random.default_rng(seed).permutation(len(data)).tolist():
        if len(out) == n:
            break
        pair = _first_exchange(data[i])
        if pair is None:
            continue
        prompt_ids = tuple(encode(pair[0]))
        out_len = len(encode(pair[1]))
        if min_len <= len(prompt_ids) <= max_input and min_len <= out_len <= max_output:
            out.append(RequestSpec(prompt_ids, None, out_len))
    if len(out) < n:
        raise ValueError(f"{path}: only {len(out)} usable conversations, {n} requested")
    return out
