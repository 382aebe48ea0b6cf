"""Packaged benchmarks, in the spirit of tf_cnn_benchmarks (installed as console scripts).

    tfdist-benchmark --model resnet50 --batch_size 32 --variable_update none     # 1 process
    horovodrun -np 2 --gloo tfdist-benchmark --model resnet50 --batch_size 16   # tfdist, 2 ranks
    tfdist-scaling --ranks 1 2 --modes none tfdist horovod --repeats 3 -- --num_batches 6

`train_benchmark` is `tfdist-benchmark` (tfdist, Horovod's own loop, MWMS or one plain process),
`modes` its --variable_update set-ups, `timing` its step timer and report, `models` its models (ResNet50 v1 and v1.5, a small CNN),
`scaling` the side-by-side runner (`tfdist-scaling`), `step_model` the step-time model
(`tfdist-predict`), `profile_summary` the per-rank profile reader (`tfdist-profile`).
"""
