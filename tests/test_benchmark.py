"""The benchmark scripts run and report in the promised format (tiny models; no timing asserted)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import BIN, ROOT, flavor_env, python_results

pytestmark = pytest.mark.multirank
TINY = ["--model", "mnist_cnn", "--image_size", "16", "--num_classes", "10", "--batch_size", "4",
        "--num_warmup_batches", "1", "--num_batches", "4", "--display_every", "2"]
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": str(BIN) + ":/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


def program(name):
    """An installed console script (`tfdist-benchmark`, ...), or a file under scripts/ run by this Python."""
    return [str(BIN / name)] if name.startswith("tfdist-") else [sys.executable, str(ROOT / "scripts" / name)]


def script(name, args, np=None):
    command = [*program(name), *map(str, args)]
    if np:
        command = [str(BIN / "horovodrun"), "-np", str(np), "--gloo", *command]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def script_exit_delay(name, args, np, last_line):
    """script() that also returns the seconds from printing `last_line` to the job's exit."""
    import threading
    import time

    command = [str(BIN / "horovodrun"), "-np", str(np), "--gloo", *program(name), *map(str, args)]
    proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    timer = threading.Timer(300, proc.kill)
    timer.start()
    lines, printed = [], None
    for line in proc.stdout:
        lines.append(line)
        if last_line in line:
            printed = time.monotonic()
    proc.wait()
    ended = time.monotonic()
    timer.cancel()
    out = "".join(lines)
    assert proc.returncode == 0 and printed is not None, out[-3000:]
    return out, ended - printed


@pytest.mark.parametrize("mode,np", [("none", None), ("tfdist", 2), ("horovod", 2), ("mwms", 2)])
def test_benchmark_modes_report_like_tf_cnn_benchmarks(tmp_path, mode, np):
    result = tmp_path / "r.json"
    out = script("tfdist-benchmark", [*TINY, "--variable_update", mode, "--json", result], np=np)
    assert f"Mode: {mode}  ranks: {np or 1}" in out and "Warm-up batches (excluded): 1" in out
    assert len(re.findall(r"images/sec: [\d.]+ \+/- [\d.]+ \(jitter = [\d.]+\)", out)) == 2
    assert re.search(r"total images/sec: [\d.]+\n(\[0\]<stdout>:)?rank 0, timed steps: CPU a step: Horovod's threads [\d.]+ ms", out)
    data = json.loads(result.read_text())  # ... and the file: the 4 timed steps' CPU, Horovod's threads apart
    assert len(data["step_seconds"]) == 5 and data["global_batch"] == 4 * (np or 1) and data["total_images_per_sec"] > 0
    assert (data["thread_cpu_per_step"]["exchange_threads"] >= 2) == (mode in ("tfdist", "horovod"))
    names = data["thread_cpu_by_name"]  # the same CPU by thread name, the main thread as "main"
    assert "main" in names and ("hvd_exchange" in names) == (mode in ("tfdist", "horovod"))
    # the file says what ran: the printed header and the settings TensorFlow had in effect
    assert data["header"][0].startswith("Model: mnist_cnn") and data["warmup_steps_excluded"] == 1
    assert isinstance(data["in_effect"]["onednn"], bool) and data["in_effect"]["cpus"]
    if mode == "tfdist":  # tuned before TensorFlow loaded, per rank: 1 of the 2 cores each
        assert data["early_settings"]["route"] == "import tfdist" and data["early_settings"]["layout"] == [0, 2]
    else:  # the peers run as installed: none of tfdist's settings
        assert data["early_settings"] is None and "TensorFlow defaults" in data["tuning"]


def test_seed_starts_runs_alike_and_another_seed_differently(tmp_path):
    """--seed: what the precision/compression accuracy runs pair on (same weights, dropout, data)."""
    losses = []
    for n, seed in enumerate([5, 5, 6]):
        script("tfdist-benchmark", [*TINY, "--variable_update", "none", "--seed", seed, "--json", tmp_path / f"{n}.json"])
        losses.append(json.loads((tmp_path / f"{n}.json").read_text())["step_losses"])
    assert len(losses[0]) == 5 and losses[0] == losses[1], losses
    assert losses[0][0] != losses[2][0], losses


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_steps_per_execution_times_each_call_as_its_steps(tmp_path, flavour):
    """Keras' batch hooks fire once a call: 6 steps at 2 a call are 3 calls, each split in 2 steps."""
    result = tmp_path / "spe.json"
    out = script("tfdist-benchmark", ["--model", "mnist_cnn", "--image_size", "16", "--num_classes", "10",
                                      "--batch_size", "4", "--num_warmup_batches", "2", "--num_batches", "4",
                                      "--display_every", "2", "--steps_per_execution", "2", "--keras", flavour,
                                      "--variable_update", "none", "--json", result])
    assert "steps a call: 2" in out
    data = json.loads(result.read_text())
    times, losses = data["step_seconds"], data["step_losses"]
    assert len(times) == 6 and times[0::2] == times[1::2] and losses[0::2] == losses[1::2], data
    assert len(set(times)) == 3 and data["total_images_per_sec"] > 0


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])  # tf-keras failed: no validation step count
def test_accuracy_run_reports_global_test_accuracy_and_time_to_target(tmp_path, flavour):
    script("examples/make_digits_dataset.py", [tmp_path / "digits", "--size", "16"])
    result = tmp_path / "acc.json"
    out, exit_delay = script_exit_delay(
        "tfdist-benchmark", ["--model", "mnist_cnn", "--image_size", "16", "--num_classes", "10",
                             "--batch_size", "32", "--data_dir", tmp_path / "digits" / "train",
                             "--eval_dir", tmp_path / "digits" / "test", "--epochs", "3",
                             "--target_accuracy", "0.2", "--display_every", "10", "--json", result,
                             "--keras", flavour, *(["--lr_decay", "polynomial"] if flavour == "keras3" else [])],
        np=2, last_line="final test accuracy:")
    assert "final test accuracy:" in out and "epoch 1: test accuracy" in out
    # the job ends promptly after its results (it lingered 19-22 s releasing tf.data iterators)
    assert exit_delay < 8, f"exited {exit_delay:.1f} s after its results"
    data = json.loads(result.read_text())
    epochs = data["epochs"]
    assert 1 <= len(epochs) <= 3 and data["final_test_accuracy"] == epochs[-1]["test_accuracy"]
    for e in epochs:  # global over all 360 test digits (both ranks' halves), not one rank's
        assert e["test_accuracy"] * 360 == pytest.approx(round(e["test_accuracy"] * 360), abs=1e-3)
    reached = [e for e in epochs if e["test_accuracy"] >= 0.2]
    assert data["seconds_to_target"] == (round(reached[0]["seconds"], 1) if reached else None)
    steps = 1437 // 2 // 32
    assert len(data["step_seconds"]) == len(epochs) * steps  # every training step timed
    for e in epochs:  # 0.01 per replica; with --lr_decay, power 2 to 0 at the last step of epoch 3
        decayed = 0.02 * (1 - (e["epoch"] * steps - 1) / (3 * steps)) ** 2 if flavour == "keras3" else 0.02
        assert e["learning_rate"] == pytest.approx(decayed, rel=1e-5), epochs


def unbatched(args):
    """`args` without their --batch_size (tfdist-scaling sets it from --global_batch)."""
    at = args.index("--batch_size")
    return args[:at] + args[at + 2:]


def test_scaling_runner_tabulates_and_plots_every_run(tmp_path):
    out = script("tfdist-scaling", ["--ranks", "1", "2", "--modes", "none", "none@core", "mwms", "--repeats", "1",
                                    "--global_batch", "8", "--out", tmp_path / "s", "--", *unbatched(TINY)])
    table = [line.split("|")[1:-1] for line in (tmp_path / "s.md").read_text().splitlines()[2:]]
    assert [row[:3] for row in table] == [[" none ", " 1 ", " 8 "], [" none@core ", " 1 ", " 4 "],
                                          [" mwms ", " 1 ", " 8 "], [" mwms ", " 2 ", " 8 "]]
    saved = json.loads((tmp_path / "s.json").read_text())
    runs = saved["runs"]
    assert sorted(runs) == ["mwms/1", "mwms/2", "none/1", "none@core/1"] and all(len(r) == 1 for r in runs.values())
    (core,) = saved["every_run"]["none@core/1"]
    assert core["args"]["batch_size"] == 4 and core["in_effect"]["cpus"] == [min(os.sched_getaffinity(0))]
    step = {row[0].strip(): float(row[7]) for row in table}
    assert float(table[3][8]) == pytest.approx(step["mwms"] - step["none@core"], abs=0.02)  # 2 ranks' overhead
    assert [row[8].strip() for row in table[:3]] == ["-", "-", "-"]
    for config, results in saved["every_run"].items():  # every run kept whole, not only its rate
        (result,) = results
        assert result["total_images_per_sec"] == runs[config][0] and len(result["step_seconds"]) == 5
        assert result["header"] and "onednn" in result["in_effect"] and result["repeat"] == 1
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "plot:" in out


def test_scaling_modes_parse_like_a_shell_line():
    from tfdist.benchmark.scaling import parse_mode

    assert parse_mode("HOROVOD_CYCLE_TIME=40 A=b=c tfdist:tf_keras@mpirun --no_tuning") == (
        {"HOROVOD_CYCLE_TIME": "40", "A": "b=c"}, "tfdist", "mpirun", "tf_keras", ["--no_tuning"])
    assert parse_mode("none") == ({}, "none", "", "", [])
    assert parse_mode("none@core") == ({}, "none", "core", "", [])
    for bad, says in (("X=1", "no --variable_update value"), ("tfdist@srun", "can only be mpirun"),
                      ("tfdist@core", "@core runs one plain process")):
        with pytest.raises(SystemExit, match=says):
            parse_mode(bad)


@pytest.mark.skipif(not __import__("shutil").which("mpirun"), reason="no mpirun: bash scripts/bootstrap.sh --with-mpi")
def test_scaling_modes_take_a_launcher_variables_and_options(tmp_path):
    from tfdist import collectives

    if not collectives.horovod().mpi_built():
        pytest.skip("Horovod was built without MPI")
    script("tfdist-scaling", ["--ranks", "2", "--modes", "tfdist@mpirun --bucket_mb 0", "HOROVOD_CYCLE_TIME=7 tfdist",
                              "--repeats", "1", "--global_batch", "8", "--out", tmp_path / "s", "--", *TINY])
    runs = json.loads((tmp_path / "s.json").read_text())["every_run"]
    assert sorted(runs) == ["HOROVOD_CYCLE_TIME=7 tfdist/2", "tfdist@mpirun --bucket_mb 0/2"]
    (mpi,) = runs["tfdist@mpirun --bucket_mb 0/2"]
    assert mpi["command"][1:4] == ["--launcher", "mpirun", "-np"] and mpi["args"]["bucket_mb"] == 0
    assert mpi["in_effect"]["open_mpi"] == "yields" and "variables" not in mpi   # tfdist's default under mpirun
    (gloo,) = runs["HOROVOD_CYCLE_TIME=7 tfdist/2"]
    assert gloo["variables"] == {"HOROVOD_CYCLE_TIME": "7"} and "horovodrun" in gloo["command"][0]
    assert gloo["in_effect"]["open_mpi"] is None and "Horovod cycle" not in gloo["tuning"]   # the run's own value


def test_resnet50_v15_has_the_reference_parameter_count():
    from tfdist.benchmark.models import build_model

    from tfdist.keras.flavour import keras_module

    model = build_model(keras_module(), "resnet50_v1.5", 224, 1000)
    # 25,557,032 trainable: the published ResNet50 v1.5 count (torchvision's resnet50 too; no conv
    # biases, which keras.applications' v1 has); plus BatchNorm's moving mean and variance
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert trainable == 25_557_032 and model.count_params() == trainable + 2 * 26_560
    strides = {layer.name: layer.strides for layer in model.layers[1].layers if "_conv" in layer.name}
    assert strides["conv3_block1_2_conv"] == (2, 2) and strides["conv3_block1_1_conv"] == (1, 1)


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_transformers_have_gpt2s_size_and_their_flops_count_every_matmul(flavour):
    code = """
import json
import numpy as np
from tfdist.benchmark import transformers
from tfdist.keras.flavour import keras_module
found = {}
for name, seq_len in (("gpt2_small", 1024), ("bert_mini", 64)):
    model = transformers.build(keras_module(), name, seq_len)
    kernels = [w for w in model.weights if "kernel" in w.name or "kernel" in getattr(w, "path", "")]
    found[name] = {"params": model.count_params(), "kernels": sum(int(np.prod(w.shape)) for w in kernels),
                   "sparse_tables": [w.name for w in model.weights if w.shape[0] in (2,)]}
print("RESULT " + json.dumps(found))
"""
    found = json.loads(python_results(code, env=flavor_env(flavour))[-1])
    from tfdist.benchmark import transformers

    # GPT-2 small's 124,439,808 (tied embeddings, 1024 positions) plus this model's untied output
    # projection over the vocabulary (kernel and bias)
    assert found["gpt2_small"]["params"] == 124_439_808 + 768 * 50257 + 50257
    for name in ("gpt2_small", "bert_mini"):
        assert found[name]["kernels"] == transformers.matmul_weights(name), name
    assert transformers.train_flops_per_token("gpt2_small", 1024) == 3 * (2 * 123_532_032 + 4 * 12 * 1024 * 768)
    assert len(found["bert_mini"]["sparse_tables"]) == 1  # the 2-row segment table


def test_transformer_benchmark_reports_tokens_flops_and_efficiency_sharded_on_two_ranks(tmp_path):
    result = tmp_path / "r.json"
    out = script("tfdist-benchmark", ["--model", "bert_mini", "--seq_len", "16", "--batch_size", "2",
                                      "--num_warmup_batches", "1", "--num_batches", "2", "--display_every", "2",
                                      "--optimizer", "adamw", "--shard_optimizer_state", "--matmul_gflops", "50",
                                      "--json", result], np=2)
    assert re.search(r"Tokens: 16 a sequence, 64 a step; model FLOPs a training token: [\d.]+ M; optimizer: "
                     r"adamw, sharded state", out), out
    assert re.search(r"total tokens/sec: [\d.]+", out) and re.search(r"of the matmul rate given \(50 GFLOP/s\)", out)
    data = json.loads(result.read_text())
    from tfdist.benchmark import transformers

    flops = transformers.train_flops_per_token("bert_mini", 16)
    assert data["train_flops_per_token"] == flops
    np.testing.assert_allclose(data["total_tokens_per_sec"], 16 * data["total_images_per_sec"])
    np.testing.assert_allclose(data["efficiency"], data["total_tokens_per_sec"] * flops / 1e9 / 50)
    assert all(np.isfinite(data["step_losses"]))


def test_two_tower_has_its_tables_sparse_gradients_and_skewed_ids():
    import tensorflow as tf

    from tfdist.benchmark import models, recommenders
    from tfdist.keras.flavour import keras_module

    model = models.build_model(keras_module(), "two_tower", 0, 0)
    rows, width = recommenders.CONFIGS["two_tower"]["rows"], recommenders.CONFIGS["two_tower"]["width"]
    assert model.count_params() == 2 * (rows * width + width * width + width) + 2 * width + 2
    (users, items), labels = next(iter(models.synthetic_input("two_tower", 256, 0)[0]))
    assert users.shape == items.shape == labels.shape == (256, 1)
    assert len(np.unique(users)) < 0.8 * 256 <= len(np.unique(items))  # popular users repeat within a batch
    assert set(np.unique(labels)) == {0, 1} and 0 <= int(tf.reduce_min(users)) and int(tf.reduce_max(items)) < rows
    # batches differ as real traffic's (so does a table gradient's count of distinct rows), cycling after BATCHES
    batches = list(models.synthetic_input("two_tower", 256, 0)[0].take(recommenders.BATCHES + 1))
    assert len({len(np.unique(b[0][0])) for b in batches}) > 1
    assert all(np.array_equal(a, b) for a, b in zip(tf.nest.flatten(batches[0]), tf.nest.flatten(batches[-1])))
    assert not np.array_equal(batches[0][0][1], batches[1][0][1])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras_module().losses.sparse_categorical_crossentropy(labels, model([users, items])))
    grads = tape.gradient(loss, model.trainable_variables)
    sparse = [v.name for g, v in zip(grads, model.trainable_variables) if isinstance(g, tf.IndexedSlices)]
    assert len(sparse) == 2 and len(grads) == 8, sparse  # both tables; the towers' and the head's dense


@pytest.mark.skipif(not __import__("importlib.util").util.find_spec("tensorflow_recommenders"),
                    reason="tensorflow-recommenders is not installed (bash scripts/bootstrap.sh installs it)")
def test_tfrs_retrieval_is_tfrss_in_batch_softmax_with_sparse_tables():
    code = """
import numpy as np, tensorflow as tf
from tfdist.benchmark import models, recommenders
from tfdist.keras.flavour import keras_module
keras = keras_module()
model = models.build_model(keras, "tfrs_retrieval", 0, 0)
(users, items), labels = next(iter(models.synthetic_input("tfrs_retrieval", 64, 0)[0]))
config = recommenders.CONFIGS["tfrs_retrieval"]
assert int(tf.reduce_max(users)) < config["user_rows"] < int(tf.reduce_max(items)) < config["rows"]
with tf.GradientTape() as tape:
    loss = models.training_loss(keras, "tfrs_retrieval")(model, (users, items), labels)
u, i = model.users(users[:, 0]), model.items(items[:, 0])
scores = tf.matmul(u, i, transpose_b=True)  # each user's own item against the batch's others
want = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(tf.eye(64), scores))
np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
grads = tape.gradient(loss, model.trainable_variables)
assert [type(g).__name__ for g in grads] == ["IndexedSlices", "IndexedSlices"], grads
assert [tuple(v.shape) for v in model.trainable_variables] == [(943, 32), (1682, 32)]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**ENV, "TF_USE_LEGACY_KERAS": "1"})
    assert out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]


def test_resnet20_has_the_cifar_resnets_size():
    from tfdist.benchmark.models import build_model

    from tfdist.keras.flavour import keras_module

    model = build_model(keras_module(), "resnet20", 32, 10)
    # He et al.'s 0.27 M: stem 432 + BN 32, stages 14,016 + 51,648 + 205,696 (1x1 projections and
    # their BN included), logits 650; plus BatchNorm's moving mean and variance (784 channels)
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert trainable == 272_474 and model.count_params() == trainable + 2 * 784
    assert tuple(model.layers[1].get_layer("avg_pool").input.shape) == (None, 8, 8, 64)


@pytest.mark.parametrize("args,expect", [
    (["--num_batches", "-3"], "argument --num_batches: -3 is not a positive integer"),
    (["--batch_size", "0"], "argument --batch_size: 0 is not a positive integer"),
    (["--learning_rate", "-0.1"], "argument --learning_rate: -0.1 is not positive"),
    (["--profile_steps", "5"], "--profile_steps needs --profile_dir (where to write the profile)"),
    (["--target_accuracy", "90"], "argument --target_accuracy: 90 is not in (0, 1]"),
    (["--model", "resnet5O"], "unknown model 'resnet5O': did you mean 'resnet50'? known models: resnet50, "
                              "resnet50_v1.5, resnet20, mnist_cnn, trivial, gpt2_small, gpt_mini, bert_mini, two_tower, "
                              "tfrs_retrieval; or give "
                              "your own as module:function"),
    (["--model", "gpt_mini", "--data_dir", "/data"], "--model gpt_mini trains on synthetic inputs: no --data_dir"),
    (["--shard_optimizer_state", "--variable_update", "horovod"],
     "--shard_optimizer_state is for --variable_update tfdist, not horovod"),
    (["--model", "vgg16"], "unknown model 'vgg16': known models: resnet50,"),
    (["--lr_decay", "polynomial"], "--lr_decay needs --epochs"),
    (["--loss_scale", "--variable_update", "horovod"], "--loss_scale is for the Keras modes"),
    (["--bucket_mb", "0", "--variable_update", "mwms"], "--bucket_mb is for --variable_update tfdist, not mwms"),
    (["--bucket_mb", "-1"], "argument --bucket_mb: -1 is negative"),
    (["--model", "tfrs_retrieval"], "--model tfrs_retrieval runs on tf-keras, TFRS's Keras: add --keras tf_keras"),
    (["--steps_per_execution", "4", "--num_warmup_batches", "2"],
     "--steps_per_execution 4: --num_warmup_batches (2) and --num_batches (10) must be multiples of it"),
    (["--steps_per_execution", "2", "--variable_update", "horovod"], "--steps_per_execution is for the Keras modes"),
])
def test_bad_arguments_fail_at_parse_time_before_tensorflow_loads(args, expect):
    code = ("import sys\nfrom tfdist.benchmark import run\n"
            f"sys.argv = ['tfdist-benchmark', *{args!r}]\n"
            "try:\n    run.main()\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'tensorflow' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.stdout.strip() == "exit 2 False", out.stdout + out.stderr  # a usage error, TensorFlow never loaded
    assert expect in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(bool(__import__("tfdist.tuning.gpu").gpu.visible_ids()), reason="a GPU is visible here")
@pytest.mark.parametrize("mode", ["tfdist", "horovod"])
def test_device_gpu_without_a_gpu_fails_naming_what_it_found(mode):
    out = subprocess.run([str(BIN / "tfdist-benchmark"), *TINY, "--device", "gpu",
                          "--variable_update", mode], capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tfdist-benchmark --device gpu: rank 0 (host ") and "asked for a GPU" in last
    assert "no NVIDIA driver loaded" in last and "CUDA_VISIBLE_DEVICES" in last and "Fix:" in last
    assert "Traceback" not in out.stderr


def test_model_argument_keeps_the_module_function_form():
    from tfdist.benchmark.train_benchmark import PARSER

    assert PARSER.parse_args(["--model", "my_models:small_cnn"]).model == "my_models:small_cnn"
    assert PARSER.parse_args(["--model", "resnet50_v1.5"]).model == "resnet50_v1.5"


def test_multihost_worker_trains_its_steps_on_each_rank(tmp_path):
    """scripts/benchmarks/multihost/worker.py (run in emulated hosts by multihost_benchmark): its
    own arguments feed tfdist-benchmark's loops (a field missing there once failed every link run)."""
    common = ["--model", "trivial", "--image_size", "8", "--num_classes", "4", "--batch_size", "4",
              "--warmup", "1", "--steps", "2", "--keras", "keras3"]
    script("benchmarks/multihost/worker.py", ["--mode", "tfdist", "--compression", "bf16", *common,
                                              "--out", tmp_path / "tfdist"], np=2)
    script("benchmarks/multihost/worker.py", ["--mode", "horovod_fit", *common[:-1], "tf_keras",
                                              "--out", tmp_path / "horovod_fit"], np=2)
    script("benchmarks/multihost/worker.py", ["--mode", "none", *common, "--out", tmp_path / "none"])
    for rank in (0, 1):
        result = json.loads((tmp_path / "tfdist" / f"rank{rank}.json").read_text())
        assert result["rank"] == rank and len(result["step_seconds"]) == 3, result  # and Horovod's threads, named:
        assert result["launched"].startswith("HorovodStrategy(") and f"rank {rank} of 2" in result["launched"]
        horovods = json.loads((tmp_path / "horovod_fit" / f"rank{rank}.json").read_text())  # hvd.DistributedOptimizer + fit
        assert horovods["rank"] == rank and len(horovods["step_seconds"]) == 3, horovods
        assert min(r["thread_cpu_per_step"]["exchange_threads"] for r in (result, horovods)) >= 2
    alone = json.loads((tmp_path / "none" / "rank0.json").read_text())
    assert alone["gradient_bytes"] == (8 * 8 * 3 * 4 + 4) * 4 and len(alone["step_seconds"]) == 3
    assert alone["sparse_gradient_bytes"] == 0
    # Each table's gradient counts as the batch's 8 rows of 64 floats and their int32 indices, not 200_000 rows
    script("benchmarks/multihost/worker.py", ["--mode", "none", "--model", "two_tower", "--batch_size", "8",
                                              "--warmup", "0", "--steps", "1", "--keras", "keras3",
                                              "--out", tmp_path / "two_tower"])
    tables = json.loads((tmp_path / "two_tower" / "rank0.json").read_text())
    towers = 2 * (64 * 64 + 64) + 64 * 2 + 2
    assert tables["sparse_gradient_bytes"] == 2 * 8 * (64 * 4 + 4), tables
    assert tables["gradient_bytes"] == towers * 4 + tables["sparse_gradient_bytes"], tables


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) % 2 == 1, reason="needs an even number of cores")
def test_ranks_per_node_runs_each_config_where_it_says_and_its_model_adds_up(tmp_path):
    """scripts/benchmarks/ranks_per_node.py: `two` is 2 Horovod ranks, `apart` two one-rank
    processes on disjoint halves of the cores at once, `alone` one of them; two/one = 1/(s k + x)."""
    import os

    out = tmp_path / "rpn"
    script("benchmarks/ranks_per_node.py", ["--global_batch", "8", "--repeats", "1", "--out", out, "--",
                                            "--model", "trivial", "--image_size", "8", "--num_classes", "4",
                                            "--num_warmup_batches", "1", "--num_batches", "2"])
    data = json.loads(out.with_suffix(".json").read_text())
    runs = data["by_batch"]["8"]["runs"]
    assert [r["ranks"] for r in runs["two"][0]] == [2] and runs["two"][0][0]["global_batch"] == 8
    cores = sorted(os.sched_getaffinity(0))
    apart = [r["in_effect"]["cpus"] for r in runs["apart"][0]]
    assert sorted(apart) == [cores[:len(cores) // 2], cores[len(cores) // 2:]], apart
    assert [r["in_effect"]["cpus"] for r in runs["alone"][0]] == [cores[:len(cores) // 2]]
    assert all(r["ranks"] == 1 and r["global_batch"] == 4 for r in runs["apart"][0] + runs["alone"][0])
    model = data["by_batch"]["8"]["model"]
    assert model["two_over_one"] == pytest.approx(1 / (model["split"] * model["contention"] + model["exchange_share"]))
    assert "| 8 |" in out.with_suffix(".md").read_text()


def test_multihost_worker_passes_loss_scale_through_tfdist_benchmarks_parser():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mh_worker", ROOT / "scripts/benchmarks/multihost/worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    for flags, expect in (([], False), (["--loss_scale"], True)):
        args = worker.PARSER.parse_args(["--mode", "tfdist", "--out", "x", *flags])
        assert worker.benchmark_args(args).loss_scale is expect


def test_collective_latency_reports_horovods_cycle_idle_cost_and_eager_allreduces(tmp_path):
    """scripts/benchmarks/collective_latency.py with Horovod's cycle as HorovodStrategy() sets it on CPU."""
    command = [str(BIN / "horovodrun"), "-np", "2", "--gloo", *program("benchmarks/collective_latency.py"),
               "--elements", "10", "--repeats", "3", "--warmup", "1", "--eager", "--idle_seconds", "0.5",
               "--json", tmp_path / "latency.json"]
    env = {**ENV, "HOROVOD_CYCLE_TIME": "10", "HOROVOD_CYCLE_ON_ENQUEUE": "1"}
    out = subprocess.run(list(map(str, command)), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    facts = json.loads((tmp_path / "latency.json").read_text())
    assert facts["starts_on_enqueue"] is True and facts["eager"] is True and facts["cycle_ms"] == "10"
    assert facts["idle_core_percent"] >= 0 and [r["bytes"] for r in facts["results"]] == [40]
    assert "started on enqueue: True (Horovod's word), eager" in out.stdout


def test_changed_rows_benchmark_ends_with_equal_tables_both_ways(tmp_path):
    """scripts/benchmarks/changed_rows.py on 3 ranks and a table of 40 rows of 5 (cut flat: rows
    split between ranks): both ways leave every rank the same table, for every fraction."""
    out = tmp_path / "changed_rows"
    script("benchmarks/changed_rows.py", ["--ranks", "3", "--rows", "40", "--width", "5", "--fractions", "1", "0.3",
                                          "--steps", "2", "--repeats", "1", "--out", out])
    ranks = json.loads(out.with_suffix(".json").read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert [x["fraction"] for x in r["results"]] == [1.0, 0.3]
        assert all(x["tables_equal"] for x in r["results"]), r
        assert r["results"][0]["rows_changed_on_this_rank"] > r["results"][1]["rows_changed_on_this_rank"] > 0
    assert "| 30% |" in out.with_suffix(".md").read_text()
