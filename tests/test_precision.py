"""Precision policy choice on synthetic hardware, and explicit policies."""

import pytest

from tfdist import precision


@pytest.mark.parametrize("gpus,flags,expected", [
    ([{"compute_capability": (8, 0)}, {"compute_capability": (8, 0)}], set(), "mixed_float16"),
    ([{"compute_capability": (7, 0)}], set(), "mixed_float16"),
    ([{"compute_capability": (6, 1)}], {"avx512_bf16"}, "float32"),  # the GPU decides
    ([], {"avx2", "amx_bf16", "amx_tile"}, "mixed_bfloat16"),
    ([], {"avx512f", "avx512_bf16"}, "mixed_bfloat16"),
    ([], {"avx2", "fma"}, "float32"),
])
def test_auto_policy_follows_the_hardware(gpus, flags, expected):
    policy, reason = precision.choose_policy(gpus=gpus, flags=flags)
    assert policy == expected and reason


def test_tuning_line_names_a_faster_precision_under_float32():
    import keras

    assert precision.policy_name(gpus=[], flags={"avx2", "fma"}) == "Keras policy float32"
    line = precision.policy_name(gpus=[], flags={"avx512f", "avx512_bf16"})
    assert line.startswith("Keras policy float32 (mixed_bfloat16 is faster here, CPU supports avx512_bf16")
    assert 'precision="auto"' in line
    try:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")  # asked for: nothing more to say
        assert precision.policy_name(gpus=[], flags={"avx512_bf16"}) == "Keras policy mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_explicit_and_invalid_policies():
    import keras

    try:
        assert precision.set_policy("mixed_bfloat16") == "mixed_bfloat16"
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
        with pytest.raises(ValueError, match="precision policy 'half'"):
            precision.set_policy("half")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_float32_softmax_head_under_a_mixed_policy():
    import keras
    import numpy as np

    try:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        logits = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model = precision.float32_softmax(logits)
        x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
        out = model(x)
        assert logits(x).dtype == "bfloat16" and out.dtype == "float32"
        z = np.asarray(logits(x)).astype("float32")
        expected = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
