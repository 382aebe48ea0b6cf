#!/usr/bin/env bash
# The README's test command: set up what is missing (venv, packages, Horovod build), then run pytest.
#   bash scripts/run_tests.sh [pytest args]
# The tests use Open MPI, Slurm, Chromium and iproute2, so bootstrap installs those too (as root).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/scripts/bootstrap.sh" --for-tests
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
# TFDIST_TEST_WORKERS=N: N pytest workers, each taking whole files (their launches are cached per
# module). One by default: on 2 cores two workers saved only about 9% and starved a timing test
# (docs/TESTING.md#ci-time).
WORKERS=${TFDIST_TEST_WORKERS:-1}
if [ "$WORKERS" -gt 1 ]; then set -- -n "$WORKERS" --dist loadfile "$@"; fi
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider "$@"
