"""The GPU tier: real 2-rank jobs on GPUs (`pytest -m gpu`); skipped, saying why, where none is visible.

Runs in the default suite wherever `nvidia-smi -L` lists a GPU (the GPU stack is then what
`scripts/bootstrap.sh` installs). 2 GPUs or more: one per rank; one GPU: the 2 ranks share it.
"""

import json
import shutil
import subprocess

import numpy as np
import pytest

from conftest import BIN, ROOT, run_job

WORKERS = ROOT / "tests" / "multirank"


def listed_gpus():
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H100 ... (UUID: ...)"), [] without a driver."""
    if not shutil.which("nvidia-smi"):
        return []
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if line.startswith("GPU ")] if done.returncode == 0 else []


GPUS = listed_gpus()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multirank,
    pytest.mark.skipif(not GPUS, reason="no GPU visible (nvidia-smi lists none): the GPU tier runs where one is; "
                       "docs/GPU.md"),
]

_cache = {}


def gpu_job(tmp_path_factory):
    if "job" not in _cache:
        base = tmp_path_factory.mktemp("gpu")
        env = {"HOROVOD_TIMELINE": "DYNAMIC"}
        ranks = run_job([WORKERS / "gpu_checks.py"], base / "ranks", np=2, env=env)
        reference = run_job([WORKERS / "gpu_checks.py", "--reference"], base / "ref", np=None)
        _cache["job"] = ranks, reference[0]
    return _cache["job"]


def test_each_rank_runs_on_its_own_gpu(tmp_path_factory):
    ranks, _ = gpu_job(tmp_path_factory)
    facts = [r["facts"] for r in ranks]
    for f, r in zip(facts, ranks):
        assert "GPU" in f["replica_device"] and len(f["tf_visible_gpus"]) == 1
        assert all("GPU" in d for d in r["variable_devices"])
        assert f["in_effect"]["gpus"][0]["memory_growth"] is True
        assert "GPU " in f["tuning"] and "memory growth on" in f["tuning"]
    if len(GPUS) >= 2:  # CUDA_VISIBLE_DEVICES narrowed before TensorFlow loaded, one entry per rank
        assert facts[0]["cuda_visible_devices"] != facts[1]["cuda_visible_devices"]
    else:
        assert "share" in facts[0]["tuning"] or "the one GPU" in facts[0]["tuning"]


def test_nccl_carries_the_gradients(tmp_path_factory):
    ranks, _ = gpu_job(tmp_path_factory)
    assert ranks[0]["facts"]["transport"].startswith("collectives NCCL ")
    assert "NCCL_ALLREDUCE" in ranks[0]["timeline_activities"], ranks[0]["timeline_activities"]


def test_two_gpu_ranks_give_the_one_process_weights(tmp_path_factory):
    ranks, reference = gpu_job(tmp_path_factory)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    for a, b in zip(ranks[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_xla_on_two_gpu_ranks_gives_the_one_process_weights(tmp_path_factory):
    ranks, reference = gpu_job(tmp_path_factory)
    assert ranks[0]["xla_weights"] == ranks[1]["xla_weights"]
    for a, b in zip(ranks[0]["xla_weights"], reference["xla_weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_auto_precision_is_mixed_float16_on_tensor_core_gpus(tmp_path_factory):
    ranks, _ = gpu_job(tmp_path_factory)
    capability = tuple(ranks[0]["facts"]["in_effect"]["gpus"][0]["compute_capability"])
    assert ranks[0]["facts"]["auto_policy"] == ("mixed_float16" if capability >= (7, 0) else "float32")


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path_factory):
    ranks, _ = gpu_job(tmp_path_factory)
    assert ranks[0]["compute_dtype"] == "float16"
    s0, s1 = ranks[0]["loss_scaling"], ranks[1]["loss_scaling"]
    assert len(s0) == 6 and s0 == s1  # same scale and weights on both ranks after every step
    scales = [s["scale"] for s in s0]
    assert scales[2] == scales[1] / 2 and s0[2]["weights"] == s0[1]["weights"]  # step 2 skipped
    assert s0[3]["weights"] != s0[2]["weights"]  # training went on


def test_benchmark_amp_path_runs_on_gpus(tmp_path):
    result = tmp_path / "bench.json"
    command = [str(BIN / "tfdist-run"), "-np", "2", str(BIN / "tfdist-benchmark"), "--model", "resnet50_v1.5",
               "--device", "gpu", "--precision", "fp16", "--batch_size", "64", "--num_warmup_batches", "3",
               "--num_batches", "10", "--json", str(result)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(result.read_text())
    assert data["total_images_per_sec"] > 0 and "precision: mixed_float16" in data["header"][2]
    assert any(line.startswith("In effect") and "GPU " in line for line in data["header"])


def test_benchmark_xla_path_runs_on_gpus(tmp_path):
    """NVIDIA's ResNet50 recipe (AMP + XLA) on 2 ranks: XLA compiles around the allreduce."""
    result = tmp_path / "bench.json"
    command = [str(BIN / "tfdist-run"), "-np", "2", str(BIN / "tfdist-benchmark"), "--model", "resnet50_v1.5",
               "--device", "gpu", "--precision", "fp16", "--xla", "--batch_size", "64", "--num_warmup_batches", "3",
               "--num_batches", "10", "--json", str(result)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(result.read_text())
    assert data["total_images_per_sec"] > 0 and "xla: True" in data["header"][2]
