#!/bin/bash
cd <scratch>/wt
lscpu | egrep 'Model name|CPU family|Model:|^CPU\(s\)|Flags' | cut -c1-200
date -u
for b in 8192 1024; do
  if [ $b = 8192 ]; then steps="--num_warmup_batches 5 --num_batches 30 --display_every 15"; else steps="--num_warmup_batches 10 --num_batches 150 --display_every 50"; fi
  .venv/bin/tfdist-scaling --ranks 2 --modes none none@core tfdist horovod mwms --repeats 4 --global_batch $b \
     --out <scratch>/tfrs/bench/r4_tfrs_$b -- --model tfrs_retrieval --keras tf_keras $steps
  echo "RC $? batch $b"; date -u
done
