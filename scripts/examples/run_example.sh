#!/usr/bin/env bash
# The README's digits example: set up what is missing, then train the digits CNN on 2 Horovod ranks.
#   bash scripts/examples/run_example.sh [extra args for digits_cnn.py]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
exec "$ROOT/.venv/bin/horovodrun" -np "${NP:-2}" --gloo "$ROOT/.venv/bin/python" scripts/examples/digits_cnn.py "$@"
