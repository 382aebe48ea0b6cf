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
