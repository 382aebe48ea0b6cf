#!/usr/bin/env bash
# ResNet50 fp32 224x224 synthetic, global batch 16: XLA vs no XLA, 1 and 2 ranks, interleaved, two rounds.
cd /work/main
export TF_CPP_MIN_LOG_LEVEL=2
out=${OUT:-/tmp/xlabench}; mkdir -p $out
COMMON="--model resnet50 --num_warmup_batches 3 --num_batches 8 --display_every 4"
run() { # name np xla
  local name=$1 np=$2 flag=$3 bs=$((16 / $2))
  local start=$(date +%s)
  .venv/bin/tfdist-run -np $np .venv/bin/tfdist-benchmark $COMMON --batch_size $bs $flag --json $out/$name.json > $out/$name.log 2>&1
  echo "$name rc=$? wall=$(( $(date +%s) - start ))s $(grep -h 'total images/sec' $out/$name.log | tail -1)"
}
for round in 1 2; do
  if [ $round = 1 ]; then order="1n 1x 2n 2x"; else order="2x 2n 1x 1n"; fi
  for c in $order; do
    np=${c:0:1}; flag=""; [ "${c:1:1}" = x ] && flag="--xla"
    run r${round}-np${np}-${c:1:1} $np "$flag"
  done
done
