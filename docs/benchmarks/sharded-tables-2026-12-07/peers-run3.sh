#!/usr/bin/env bash
# tf-keras, Adagrad, two_tower on 2 ranks: mirrored variables' sparse_read (this commit) against 6f39760
# (<scratch>/head), beside Horovod's loop and MWMS
set -u
date -u
tfdist-scaling --ranks 2 --modes tfdist:tf_keras "PYTHONPATH=<scratch>/head tfdist:tf_keras" horovod mwms none:tf_keras \
    --repeats 3 --global_batch 512 --out sparse_read_adagrad_tf_keras -- --model two_tower --optimizer adagrad \
    --num_warmup_batches 10 --num_batches 50 --display_every 25
date -u
