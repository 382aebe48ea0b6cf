"""The flavour-agnostic unit tests again, under tf-keras (TF_USE_LEGACY_KERAS=1), in one subprocess.

Keras picks its flavour at import time, so this cannot happen inside the main pytest process.
"""

import os
import subprocess
import sys

from conftest import ROOT

FLAVOUR_AGNOSTIC = ["tests/test_lr_schedule.py", "tests/test_lars.py", "tests/test_profiling.py"]


def test_unit_tests_pass_under_tf_keras():
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FLAVOUR_AGNOSTIC],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
