#!/usr/bin/env bash
# The README's main job: set up what is missing, then benchmark ResNet50 training on synthetic data:
# one process with TensorFlow's defaults, tfdist on 1 rank and on 2 ranks, same global batch,
# printing a table (about 5 minutes on 2 CPU cores). Extra arguments go to tfdist-benchmark.
# Where the CPU has AVX512-BF16 or AMX (or BENCH_BF16=1), the same rows run in bfloat16 too
# (--precision bf16, i.e. Keras' mixed_bfloat16) and the speed-ups over float32 are printed.
# Each row is also quoted against the machine's own matmul rate in its precision (matmul_rate.py,
# measured before and after the runs, their mean; both are printed, as a VM's neighbours can move
# the rates within minutes): ResNet50 at 224x224 is taken as 24.5 GFLOP per training image.
#   bash scripts/benchmarks/run_benchmark.sh [--num_batches 10 ...]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
mkdir -p runs
BF16_FLAGS=$(grep -o -w -E 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ' || true)
MODES=(none tfdist)
if [ -n "$BF16_FLAGS" ] || [ "${BENCH_BF16:-0}" = 1 ]; then
  echo "run_benchmark: this CPU has ${BF16_FLAGS:-no bf16 flags (BENCH_BF16=1)}: bfloat16 rows too" >&2
  MODES+=("none --precision bf16" "tfdist --precision bf16")
fi
"$ROOT/.venv/bin/python" scripts/benchmarks/matmul_rate.py --json runs/matmul_rate.json
"$ROOT/.venv/bin/tfdist-scaling" --ranks 1 2 --modes "${MODES[@]}" --repeats 1 \
  --global_batch "${GLOBAL_BATCH:-16}" --out runs/benchmark -- \
  --model resnet50 --num_warmup_batches 2 --num_batches 6 --display_every 3 "$@"
"$ROOT/.venv/bin/python" scripts/benchmarks/matmul_rate.py --json runs/matmul_rate_after.json
"$ROOT/.venv/bin/python" - runs/benchmark.json runs/matmul_rate.json runs/matmul_rate_after.json "$@" <<'PY'
import json, statistics, sys
runs = json.load(open(sys.argv[1]))["runs"]
before, after = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
rates = {p: (before[p] + after[p]) / 2 for p in before}
med = {k: statistics.median(v) for k, v in runs.items()}
lines = []
if not {"--model", "--image_size"} & {a.split("=")[0] for a in sys.argv[4:]}:  # ResNet50 at 224x224
    lines += ["", "| matmul rate, GFLOP/s | before the runs | after | mean (used below) |", "|---|---|---|---|"]
    lines += [f"| {p} | {before[p]:.1f} | {after[p]:.1f} | {rates[p]:.1f} |" for p in before]
    lines += ["", "| run | images/s | GFLOP/s (24.5 a training image) | of this machine's matmul rate |",
              "|---|---|---|---|"]
    for key, images in med.items():
        precision = "bfloat16" if "bf16" in key else "float32"
        lines.append(f"| {key} | {images:.2f} | {images * 24.5:.0f} | "
                     f"{images * 24.5 / rates[precision]:.0%} of {precision}'s {rates[precision]:.0f} GFLOP/s |")
speedups = []
for ranks in (1, 2):
    bf16 = med.get(f"tfdist --precision bf16/{ranks}")
    for base in (f"tfdist/{ranks}", "none/1"):
        if bf16 and med.get(base):
            speedups.append(f"| tfdist bf16 {ranks} rank(s) vs {'TF defaults float32' if base == 'none/1' else 'tfdist float32'}"
                            f"{'' if base != 'none/1' else ' (1 process)'} | {bf16 / med[base]:.2f}x |")
if med.get("none --precision bf16/1") and med.get("none/1"):
    speedups.append(f"| TF defaults bf16 vs TF defaults float32 | {med['none --precision bf16/1'] / med['none/1']:.2f}x |")
if speedups:
    lines += ["", "| bfloat16 vs float32 | speed-up |", "|---|---|", *speedups]
print("\n".join(lines))
open("runs/benchmark.md", "a").write("\n".join(lines) + "\n")
PY
