"""Which workers serve a request.

Prefix affinity first: requests whose prompts share their first KV block (a system prompt, a
few-shot preamble, a chat history) go to the same prefill worker and the same decode worker, so
the prefill side finds the prefix in its prefix cache (not prefilled twice) and the decode side
already holds those blocks (not transferred twice: the connector pulls only what the decode
engine's own prefix cache lacks). The worker for a prefix is chosen by rendezvous hashing of
the prefix's hash with each worker id: stable while workers come and go, and spread evenly over
distinct prefixes without a shared index. Affinity is bounded by load ("consistent hashing with
bounded loads"): a worker more than `_SLACK` above the pool's mean load is passed over for the
next in the prefix's ranking, so one hot system prompt cannot pin a whole pool's traffic on one
worker.

Without a prefix (a prompt shorter than a block) or past the bound:
- prefill: the least queued prompt tokens (the router's own in flight on the worker, plus the
  requests in the worker's reported queue that are not ours, each counted at this prompt's
  length), not the fewest requests: a 2,000-token prompt costs a prefill worker twenty
  100-token ones.
- decode: power of two choices -- sample two live decode workers, take the one with more free
  KV blocks net of what the router already sent it, then fewer running requests. Two random
  probes avoid the herd that "always the least loaded" causes when load reports lag a burst.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import numpy as np

from router.registry import Worker

# A worker may carry this factor of the pool's mean load (plus one request's worth) and still
# take its prefixes' requests.
_SLACK = 1.25


def block_hashes(prompt_ids: Sequence[int], block_size: int,
                 limit: int | None = None) -> list[bytes]:
    """One digest per full KV block of the prompt (the first `limit` blocks), each covering
    everything before it too: equal digests mean equal prefixes (vLLM's prefix cache matches
    whole blocks the same way). What the router remembers of workers' caches (router/split.py)
    and what prefix affinity routes by are the same digests."""
    if block_size <= 0:
        return []
    n = len(prompt_ids) // block_size
    n = n if limit is None else min(n, limit)
    raw = np.array(prompt_ids[:n * block_size], dtype=np.uint32).tobytes()  # one pass, in C
    step = 4 * block_size
    out, prev = [], b""
    for start in range(0, n * step, step):
        prev = hashlib.blake2b(prev + raw[start:start + step], digest_size=16).digest()
        out.append(prev)
    return out


def prefix_key(prompt_ids: Sequence[int], block_size: int) -> bytes | None:
    """What requests sharing a cached prefix have in common: the digest of the prompt's first
    full KV block (vLLM caches whole blocks only). None when the prompt fills no block."""
    first = block_hashes(prompt_ids, block_size, limit=1)
    return first[0] if first else None


def _weight(worker_id: str, key: bytes) -> bytes:
    return hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest()


def home_of(key: bytes, worker_ids: Sequence[str]) -> str:
    """The worker a prefix goes to while no worker is overloaded."""
    return max(worker_ids, key=lambda i: _weight(i, key))


def _rank(workers: Sequence[Worker], key: bytes) -> list[Worker]:
    """Rendezvous order of `workers` for `key`: the first is the prefix's home."""
    return sorted(workers, key=lambda w: _weight(w.worker_id, key), reverse=True)


def _bounded(ranked: list[Worker], load, unit: float) -> Worker | None:
    """The first worker in `ranked` whose load is within the bound; `unit` is this request's
    own load, so an idle pool always takes it at home."""
    bound = _SLACK * sum(load(w) for w in ranked) / len(ranked) + unit
    return next((w for w in ranked if load(w) <= bound), None)


def _decode_score(w: Worker) -> tuple[float, int]:
    # Every in-flight request will hold blocks soon even if the last heartbeat predates it.
    per_request = max(w.load.total_kv_blocks // max(w.capacity.max_num_seqs, 1), 1)
    free = w.load.free_kv_blocks - w.inflight * per_request
    return (-free, w.load.running + w.inflight)


def _decode_load(w: Worker) -> float:
    return w.load.running + w.inflight


def choose_decode(workers: Sequence[Worker], rng: random.Random,
                  key: bytes | None = None) -> Worker:
    assert workers, "caller checks for an empty pool"
    if len(workers) == 1:
        return workers[0]
    if key is not None:
        home = _bounded(_rank(workers, key), _decode_load, 1.0)
        if home is not None and _decode_score(home)[0] < 0:  # it has free blocks
            return home
    a, b = rng.sample(list(workers), 2)
    return min((a, b), key=_decode_score)


def _prefill_load(w: Worker, prompt_tokens: int) -> float:
    """Prompt tokens queued on the worker: ours in flight, plus requests in its queue that are
    not ours (other routers'), counted at this request's length."""
    return w.inflight_tokens + max(w.load.queue_len - w.inflight, 0) * prompt_tokens


def choose_prefill(workers: Sequence[Worker], prompt_tokens: int = 1,
                   key: bytes | None = None) -> Worker:
    assert workers, "caller checks for an empty pool"

    def load(w: Worker) -> float:
        return _prefill_load(w, prompt_tokens)

    if key is not None and len(workers) > 1:
        home = _bounded(_rank(workers, key), load, prompt_tokens)
        if home is not None:
            return home
    return min(workers, key=lambda w: (load(w), w.inflight + w.load.queue_len, w.load.waiting))
