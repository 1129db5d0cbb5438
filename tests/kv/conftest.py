"""The transport tests' fixtures (tests/kv/transport_harness.py), for every test file here."""

from tests.kv.transport_harness import consumers, producers  # noqa: F401
