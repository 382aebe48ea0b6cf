#!/usr/bin/env bash
# two_tower on 2 ranks of one node, global batch 512, 3 repeats side by side:
# one process; tfdist replicated; tfdist sharded (this commit); sharded with rows cut but whole slices
# gathered (<scratch>/whole: this commit with row_local forced off); sharded as before (<scratch>/old: 79afc70,
# with only tfdist-benchmark's --optimizer choices added)
set -u
date -u; lscpu | grep -E "Model name|CPU family|^Model:"
for opt in sgd adagrad momentum adamw; do
  extra=()
  case $opt in sgd|adagrad) extra=("PYTHONPATH=<scratch>/whole tfdist --shard_optimizer_state");; esac
  tfdist-scaling --ranks 2 --modes none tfdist "tfdist --shard_optimizer_state" "${extra[@]}" \
      "PYTHONPATH=<scratch>/old tfdist --shard_optimizer_state" \
      --repeats 3 --global_batch 512 --out two_tower_$opt -- --model two_tower --optimizer $opt \
      --num_warmup_batches 10 --num_batches 50 --display_every 25
done
date -u
