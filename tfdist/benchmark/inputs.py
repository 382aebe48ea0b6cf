"""The benchmark's input: synthetic batches, or TFRecords written by `tfdist.pipelines`, per rank or global.

```python
from tfdist.benchmark.inputs import input_dataset
from tfdist.benchmark.train_benchmark import PARSER
dataset, source, plan = input_dataset(PARSER.parse_args(["--model", "mnist_cnn", "--image_size", "28"]))
```
"""

import argparse

from tfdist.benchmark.models import synthetic_description, synthetic_input


def input_dataset(args, input_context=None, training=True):
    from tfdist.pipelines import preprocessing, read_dataset

    synthetic = synthetic_input(args.model, args.batch_size, args.seq_len)
    if synthetic:
        return (*synthetic, None)
    if not args.data_dir:
        ds = preprocessing.synthetic_dataset(args.batch_size, image_size=args.image_size,
                                             num_classes=args.num_classes)
        return ds, synthetic_description(args.model), None
    mapper = preprocessing.example_mapper(training=training, image_size=args.image_size)
    source = args.data_dir if training else args.eval_dir
    ds, plan = read_dataset(source, args.batch_size, input_context=input_context, training=training,
                            augment_fn=mapper)
    return ds, f"{source} ({plan.records} records/rank, mode={plan.mode})", plan


def distributed_input(args, strategy, training):
    """(dataset, source, plan): per-replica batches from `strategy.distribute_datasets_from_function`,
    or with `args.global_input` a finite dataset of the run's steps batched by the global batch."""
    if strategy is None:
        return input_dataset(args, training=training)
    if args.global_input and training and not args.epochs:
        global_args = argparse.Namespace(**{**vars(args), "batch_size": args.batch_size * strategy.num_replicas_in_sync})
        ds, source, plan = input_dataset(global_args, training=training)
        steps = args.num_warmup_batches + args.num_batches
        return (strategy.experimental_distribute_dataset(ds.take(steps)),
                f"{source}, {steps} global batches of {global_args.batch_size}, split across ranks", plan)
    found = []

    def dataset_fn(ctx):
        found.append(input_dataset(args, ctx, training=training))
        return found[-1][0]

    ds = strategy.distribute_datasets_from_function(dataset_fn)
    return ds, found[0][1], found[0][2]
