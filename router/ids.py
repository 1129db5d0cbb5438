"""Ids the router makes for requests: unique without a system call each.

`uuid.uuid4()` reads the kernel's random source on every call, and a request needed two (its id
and the suffix that keeps workers' ids apart when clients reuse theirs): ~10 µs of the router's
time before the first token. Here 64 random bits are drawn once per process and a counter makes
each id distinct within it: two routers collide only if they draw the same 64 bits. Ids are
names, not secrets (the KV ticket that authorises a pull is signed, splitserve/credentials.py).
"""

from __future__ import annotations

import itertools
import secrets

_PROCESS = secrets.token_hex(8)
_counter = itertools.count()


def new_id() -> str:
    """A fresh id: 16 hex digits naming this process, then the counter in hex."""
    return f"{_PROCESS}{next(_counter):x}"
