"""Test-only faults (splitserve/faults.py): one way in, off by default, refused where anyone
but a test could reach the component."""

from __future__ import annotations

import pytest

from splitserve import faults
from splitserve.faults import FAULTS_ENV, NONE, Faults


def test_off_unless_the_environment_sets_them(monkeypatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert faults.for_host("10.1.2.3") is NONE and not NONE.any


def test_set_faults_reach_a_component_on_loopback_or_the_test_network(monkeypatch) -> None:
    want = Faults(stall_decode_s=2.5, corrupt_on_request=True)
    monkeypatch.setenv(FAULTS_ENV, want.to_env()[FAULTS_ENV])
    for host in ("127.0.0.1", "localhost", "::1", "198.18.0.7", "198.19.255.1"):
        assert faults.for_host(host) == want


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "192.168.1.2", "198.20.0.1"])
def test_set_faults_are_refused_where_others_could_reach(monkeypatch, host: str) -> None:
    monkeypatch.setenv(FAULTS_ENV, Faults(stall_before_send_s=1).to_env()[FAULTS_ENV])
    with pytest.raises(ValueError, match="faults are for tests"):
        faults.for_host(host)


@pytest.mark.parametrize("text,says", [("{", "not JSON"), ("[1]", "a JSON object"),
                                       ('{"stall": 1}', "unknown faults"),
                                       ('{"layer_stall_s": -1}', ">= 0")])
def test_a_bad_fault_spec_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        faults.parse(text)
