"""The benchmark scripts run and report in the promised format (tiny models; no timing asserted)."""

import json
import re
import subprocess
import sys

import pytest

from conftest import BIN, ROOT

pytestmark = pytest.mark.multirank
TINY = ["--model", "mnist_cnn", "--image_size", "16", "--num_classes", "10", "--batch_size", "4",
        "--num_warmup_batches", "1", "--num_batches", "4", "--display_every", "2"]


def bench(args, np=None, tmp_path=None):
    command = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *TINY, *args]
    if np:
        command = [str(BIN / "horovodrun"), "-np", str(np), "--gloo", *command]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": str(BIN) + ":/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("mode,np", [("none", None), ("tfdist", 2), ("horovod", 2)])
def test_benchmark_modes_report_like_tf_cnn_benchmarks(tmp_path, mode, np):
    result = tmp_path / "r.json"
    out = bench(["--variable_update", mode, "--json", str(result)], np=np)
    assert f"Mode: {mode}  ranks: {np or 1}" in out and "Warm-up batches (excluded): 1" in out
    assert len(re.findall(r"images/sec: [\d.]+ \+/- [\d.]+ \(jitter = [\d.]+\)", out)) == 2
    assert re.search(r"total images/sec: [\d.]+", out)
    data = json.loads(result.read_text())
    assert len(data["step_seconds"]) == 5 and data["global_batch"] == 4 * (np or 1)
    assert data["total_images_per_sec"] > 0
