"""The README's main job: the digits CNN on 2 ranks reaches the accuracy it promises."""

import pytest

from conftest import ROOT, run_job

pytestmark = pytest.mark.multirank


def test_digits_cnn_two_ranks_reaches_90_percent(tmp_path):
    ranks = run_job([ROOT / "scripts" / "examples" / "digits_cnn.py", "--epochs", "8"], tmp_path, np=2)
    # both ranks passed all 1,437 training digits at the global batch (2 x 32); fit split it
    assert ranks[0]["train_records"] == ranks[1]["train_records"] == 1437
    assert ranks[0]["global_batch"] == ranks[1]["global_batch"] == 64
    # the reported test accuracy is global, hence the same on both ranks
    assert ranks[0]["test"] == ranks[1]["test"]
    assert ranks[0]["test"]["accuracy"] >= 0.90


def test_first_run_script_trains_on_two_ranks_as_the_quick_start_shows():
    """README's Quick start: `tfdist-run -np 2 python scripts/examples/first_run.py`, shown whole in it."""
    import os
    import re
    import subprocess

    from conftest import BIN, communicate_or_kill

    script = ROOT / "scripts" / "examples" / "first_run.py"
    code = script.read_text().split('"""\n\n', 1)[1]  # the script after its docstring
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text()  # the README shows it as shipped
    proc = subprocess.Popen([str(BIN / "tfdist-run"), "-np", "2", "python", str(script)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)})
    stdout, stderr, timed_out = communicate_or_kill(proc, 300)  # on a timeout: every process' stacks
    assert not timed_out and proc.returncode == 0, stdout[-6000:] + stderr[-3000:]
    printed = re.findall(r"ranks: (\d+), test accuracy: ([\d.]+)", stdout)
    assert len(printed) == 1, stdout  # the chief prints the global result once
    ranks, accuracy = printed[0]
    assert ranks == "2" and float(accuracy) >= 0.9
