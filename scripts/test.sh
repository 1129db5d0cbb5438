#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
# `scripts/test.sh` is README.md's test command and all that .ci/run does: every test but the
# soak tier, the fuzzers and storms at their CI size. `scripts/test.sh --soak` runs the soak
# tier instead: the long fault runs (marked `soak`) and the fuzzers and storms at full size
# (marked `tiered`).
set -euo pipefail
cd "$(dirname "$0")/.."
select=()
if [ "${1:-}" = "--soak" ]; then
  shift
  export SPLITSERVE_SOAK=1
  select=(-m "soak or tiered")
fi
echo "== setup ($(date -u +%H:%M:%S))"
scripts/setup.sh
# The run gets a /dev/shm of its own where it can (as root, as CI runs): what a SIGKILLed process
# group leaves there goes with the run, and leak checks see this run's segments only. Elsewhere
# tests/conftest.py lists what was left, and removes nothing.
private=()
if [ "$(id -u)" = 0 ] && unshare --mount --propagation private true 2>/dev/null; then
  private=(unshare --mount --propagation private -- sh -c
           'mount -t tmpfs -o size=50%,mode=1777 splitserve-test-shm /dev/shm && exec "$@"' sh)
  export SPLITSERVE_PRIVATE_SHM=1
fi
echo "== tests ($(date -u +%H:%M:%S))${private:+, in a private /dev/shm}"
set +e
"${private[@]}" .venv/bin/python -m pytest -ra --durations=25 "${select[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest's "no tests collected" must not pass as success
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
echo "== done ($(date -u +%H:%M:%S)), pytest exit $rc"
exit "$rc"
