#!/usr/bin/env bash
# two_tower on 2 ranks of one node, global batch 512, 3 repeats side by side: tfdist sharded and
# replicated against Horovod's loop and MWMS (tf-keras), momentum SGD and Adagrad
set -u
date -u; lscpu | grep -E "Model name|CPU family|^Model:"
for opt in momentum adagrad; do
  tfdist-scaling --ranks 2 --modes "tfdist --shard_optimizer_state" tfdist horovod mwms \
      --repeats 3 --global_batch 512 --out peers_$opt -- --model two_tower --optimizer $opt \
      --num_warmup_batches 10 --num_batches 50 --display_every 25
done
date -u
