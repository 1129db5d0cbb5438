"""Test-only faults: stalls and corruption the suite injects to prove a failure path works.

They are not settings: no flag, no config field and no `--help` line names them. The one way
in is `$SPLITSERVE_FAULTS`, a JSON object of the fields below, which child processes inherit
(the engine's too, where the KV connector reads it). A component that finds it set refuses to
start unless it binds loopback or an address in 198.18.0.0/15 (the benchmarking range the
multi-host test lab uses), so a production deployment cannot be talked into one.

    SPLITSERVE_FAULTS='{"stall_decode_s": 60}' splitserve decode ...
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import time
from dataclasses import asdict, dataclass, fields

from splitserve.tls import is_loopback

FAULTS_ENV = "SPLITSERVE_FAULTS"
TEST_NETWORK = ipaddress.ip_network("198.18.0.0/15")


@dataclass(frozen=True)
class Faults:
    # decode worker: every Decode waits this long before it reaches the engine, so a test can
    # act (cancel, let a deadline pass) while the router holds a ticket nobody pulled yet
    stall_decode_s: float = 0.0
    # KV producer: pause mid-transfer, so a test can kill it there
    stall_before_send_s: float = 0.0
    # KV consumer: the layered helper pauses in each layer it takes (a slow helper shows a
    # missing wait)
    layer_stall_s: float = 0.0
    # KV consumer: honour a request's kv_transfer_params {"fault": "corrupt"} (flip received
    # bytes: proves the KV really travels, since a recompute would give the same tokens)
    corrupt_on_request: bool = False
    # router: write the modules the process loaded here at exit (the layering test's proof
    # that the router never imports torch)
    modules_file: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"${FAULTS_ENV}: {f.name} must be a number >= 0, got {value!r}")

    @property
    def any(self) -> bool:
        return self != NONE

    def to_env(self) -> dict[str, str]:
        """The environment that hands these faults to a child process."""
        return {FAULTS_ENV: json.dumps({k: v for k, v in asdict(self).items()
                                        if v != getattr(NONE, k)})}

    @staticmethod
    def stall(seconds: float) -> None:
        if seconds:
            time.sleep(seconds)


NONE = Faults()


def parse(text: str | None) -> Faults:
    if not text:
        return NONE
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"${FAULTS_ENV}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"${FAULTS_ENV}: expected a JSON object, got {text!r}")
    unknown = set(raw) - {f.name for f in fields(Faults)}
    if unknown:
        raise ValueError(f"${FAULTS_ENV}: unknown faults {sorted(unknown)}")
    return Faults(**raw)


def on_test_network(host: str) -> bool:
    if is_loopback(host):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")) in TEST_NETWORK
    except ValueError:
        return False


@functools.cache
def _from_env(text: str | None) -> Faults:
    return parse(text)


def for_host(host: str) -> Faults:
    """This process's faults, for a component bound to `host`: none unless $SPLITSERVE_FAULTS
    is set, and a ValueError if it is set while `host` is reachable from outside a test."""
    faults = _from_env(os.environ.get(FAULTS_ENV))
    if faults.any and not on_test_network(host):
        raise ValueError(f"${FAULTS_ENV} is set, and this component binds {host}: faults are "
                         f"for tests, on loopback or {TEST_NETWORK} only")
    return faults
