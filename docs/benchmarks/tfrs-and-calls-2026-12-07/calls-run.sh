#!/bin/bash
cd <scratch>/spe
lscpu | egrep 'Model name|CPU family|Model:|^CPU\(s\)'
date -u
.venv/bin/tfdist-scaling --ranks 2 --modes none "none --steps_per_execution 4" tfdist "tfdist --steps_per_execution 4" horovod \
  --repeats 3 --global_batch 64 --out <scratch>/spe/cnn -- --model mnist_cnn --image_size 28 --num_classes 10 \
  --num_warmup_batches 16 --num_batches 200 --display_every 100
echo "RC $?"; date -u
.venv/bin/tfdist-scaling --ranks 2 --modes none "none --steps_per_execution 4" tfdist "tfdist --steps_per_execution 4" horovod \
  --repeats 3 --global_batch 8 --out <scratch>/spe/gpt_mini -- --model gpt_mini --seq_len 64 \
  --num_warmup_batches 8 --num_batches 32 --display_every 16
echo "RC $?"; date -u
