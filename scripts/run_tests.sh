#!/usr/bin/env bash
# The README's test command: set up what is missing (venv, packages, Horovod build), then run pytest.
#   bash scripts/run_tests.sh [pytest args]
# The tests use Open MPI, Slurm, Chromium and iproute2, so bootstrap installs those too (as root).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/bootstrap.sh" --for-tests
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
# Two pytest workers, each taking whole files (their launches are cached per module): the suite's
# jobs wait on launches, rendezvous and timeouts, so two at once use the cores better
# (docs/TESTING.md#ci-time). TFDIST_TEST_WORKERS=1 runs them one at a time, in order.
WORKERS=${TFDIST_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 1 ]; then set -- -n "$WORKERS" --dist loadfile "$@"; fi
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider "$@"
