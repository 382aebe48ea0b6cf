#!/usr/bin/env bash
# the same on tf-keras for tfdist too (Adagrad: tf-keras updates only the looked-up rows, Keras 3 every row)
set -u
date -u
tfdist-scaling --ranks 2 --modes "tfdist:tf_keras --shard_optimizer_state" tfdist:tf_keras horovod mwms \
    --repeats 3 --global_batch 512 --out peers_adagrad_tf_keras -- --model two_tower --optimizer adagrad \
    --num_warmup_batches 10 --num_batches 50 --display_every 25
date -u
