#!/usr/bin/env bash
# The README's main job: set up what is missing, then benchmark ResNet50 training on synthetic data:
# one process with TensorFlow's defaults, tfdist on 1 rank and on 2 ranks, same global batch,
# printing a table (about 5 minutes on 2 CPU cores). Extra arguments go to tfdist-benchmark.
#   bash scripts/benchmarks/run_benchmark.sh [--num_batches 10 ...]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
mkdir -p runs
exec "$ROOT/.venv/bin/tfdist-scaling" --ranks 1 2 --modes none tfdist --repeats 1 \
  --global_batch "${GLOBAL_BATCH:-16}" --out runs/benchmark -- \
  --model resnet50 --num_warmup_batches 2 --num_batches 6 --display_every 3 "$@"
