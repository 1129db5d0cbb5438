#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
# This is README.md's test command and all that .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== setup ($(date -u +%H:%M:%S))"
scripts/setup.sh
echo "== tests ($(date -u +%H:%M:%S))"
set +e
.venv/bin/python -m pytest -ra --durations=20 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest's "no tests collected" must not pass as success
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
echo "== done ($(date -u +%H:%M:%S)), pytest exit $rc"
exit "$rc"
