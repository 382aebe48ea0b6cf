"""pipelines.preprocessing: shapes and dtypes, normalisation, random vs center crops, flips, errors."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.pipelines import read_dataset, write_examples
from tfdist.pipelines.preprocessing import (
    IMAGENET_MEAN_RGB,
    IMAGENET_STD_RGB,
    eval_preprocess,
    example_mapper,
    normalize,
    synthetic_dataset,
    train_preprocess,
)

SIZE = 32
DTYPES = [tf.float32, tf.bfloat16, tf.float16]


def pattern(height=350, width=400):
    """Red grows left to right, green top to bottom, blue is a checkerboard: every crop differs."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // (width - 1), y * 255 // (height - 1), ((x // 25 + y // 25) % 2) * 200],
                    axis=-1).astype(np.uint8)


def encode(pixels, fmt):
    return (tf.io.encode_jpeg(pixels, quality=95) if fmt == "jpeg" else tf.io.encode_png(pixels)).numpy()


def normalized(rgb):
    return (np.asarray(rgb, np.float32) - np.float32(IMAGENET_MEAN_RGB)) / np.float32(IMAGENET_STD_RGB)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_output_shape_dtype_and_label(fmt, dtype):
    data = encode(pattern(), fmt)
    for preprocess in (train_preprocess, eval_preprocess):
        image, label = preprocess(data, tf.constant(7, tf.int64), image_size=SIZE, dtype=dtype)
        assert image.shape == (SIZE, SIZE, 3)
        assert image.dtype == dtype
        assert label.numpy() == 7
        assert np.all(np.isfinite(image.numpy().astype(np.float32)))


def test_normalisation_mean_colour_is_zero_std_is_one_channels_rgb():
    mean = tf.fill([4, 4, 3], 1.0) * tf.constant(IMAGENET_MEAN_RGB)
    assert np.all(normalize(mean).numpy() == 0)
    np.testing.assert_allclose(normalize(mean + tf.constant(IMAGENET_STD_RGB)).numpy(), 1, rtol=1e-6)
    # Through decoding: channel order is RGB, values 0-255.
    for rgb in [(0, 0, 0), (255, 0, 0), (0, 0, 255), tuple(round(m) for m in IMAGENET_MEAN_RGB)]:
        data = encode(np.full((40, 50, 3), rgb, np.uint8), "png")
        image, _ = eval_preprocess(data, 0, image_size=SIZE)
        np.testing.assert_allclose(image.numpy(), np.broadcast_to(normalized(rgb), (SIZE, SIZE, 3)),
                                   atol=1e-5)
    image, _ = eval_preprocess(encode(pattern(), "png"), 0, image_size=SIZE)
    assert abs(float(tf.reduce_mean(image))) < 1 and 0.3 < float(tf.math.reduce_std(image)) < 2


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_training_crops_follow_the_random_seed(fmt):
    data = encode(pattern(), fmt)

    def crop(seed):
        tf.random.set_seed(seed)
        return train_preprocess(data, 0, image_size=SIZE)[0].numpy()

    first, second, again = crop(1), crop(2), crop(1)
    assert not np.allclose(first, second, atol=0.1)
    np.testing.assert_array_equal(first, again)
    tf.random.set_seed(3)
    crops = [train_preprocess(data, 0, image_size=SIZE)[0].numpy() for _ in range(4)]
    assert all(not np.allclose(a, b, atol=0.1) for i, a in enumerate(crops) for b in crops[i + 1:])


def bordered(height, width, border, axis):
    """Grey image whose two borders along `axis` (1: left/right, 0: top/bottom) are red."""
    pixels = np.full((height, width, 3), 128, np.uint8)
    edge = [slice(None), slice(None)]
    for part in (slice(0, border), slice(-border, None)):
        edge[axis] = part
        pixels[tuple(edge)] = (255, 0, 0)
    return pixels


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_eval_is_deterministic_and_crops_the_center(fmt):
    grey = normalized((128, 128, 128))
    for pixels in (bordered(64, 128, 16, axis=1), bordered(128, 64, 16, axis=0)):
        data = encode(pixels, fmt)
        first, _ = eval_preprocess(data, 0, image_size=SIZE)
        second, _ = eval_preprocess(data, 0, image_size=SIZE)
        np.testing.assert_array_equal(first.numpy(), second.numpy())
        np.testing.assert_allclose(first.numpy(), np.broadcast_to(grey, (SIZE, SIZE, 3)),
                                   atol=0.05 if fmt == "jpeg" else 1e-5)
    # On a square image crop_fraction decides: 1 keeps the borders, 0.5 keeps only the centre.
    square = encode(bordered(64, 64, 8, axis=1), "png")
    full, _ = eval_preprocess(square, 0, image_size=SIZE, crop_fraction=1.0)
    np.testing.assert_allclose(full.numpy()[:, 0], np.broadcast_to(normalized((255, 0, 0)), (SIZE, 3)),
                               atol=1e-5)
    half, _ = eval_preprocess(square, 0, image_size=SIZE, crop_fraction=0.5)
    np.testing.assert_allclose(half.numpy(), np.broadcast_to(grey, (SIZE, SIZE, 3)), atol=1e-5)


def test_flip_happens_sometimes():
    data = encode(pattern(), "png")
    tf.random.set_seed(0)
    mirrored = []
    for _ in range(24):
        red = train_preprocess(data, 0, image_size=SIZE)[0].numpy()[..., 0]
        left, right = red[:, : SIZE // 2].mean(), red[:, SIZE // 2:].mean()
        assert left != right  # red grows left to right in every unflipped crop
        mirrored.append(left > right)
    assert any(mirrored) and not all(mirrored)


def test_failed_crop_sampling_falls_back_to_a_center_crop():
    # So wide that no 3/4-4/3 crop covers 8% of the area: sampling always fails.
    pixels = np.full((16, 400, 3), (255, 0, 0), np.uint8)
    pixels[:, 150:250] = 128
    for fmt in ("jpeg", "png"):
        tf.random.set_seed(5)
        for _ in range(3):
            image, _ = train_preprocess(encode(pixels, fmt), 0, image_size=SIZE)
            np.testing.assert_allclose(image.numpy(), np.broadcast_to(normalized((128,) * 3), (SIZE, SIZE, 3)),
                                       atol=0.05 if fmt == "jpeg" else 1e-5)


def test_example_mapper_in_read_dataset_and_dataset_map(tmp_path):
    examples = [{"image": encode(pattern(60 + 10 * i, 90 - 5 * i), "jpeg" if i % 2 else "png"),
                 "label": np.int64(i)} for i in range(6)]
    write_examples(examples, tmp_path / "ds", min_shards=2)
    ds, plan = read_dataset(tmp_path / "ds", batch_size=2, training=True,
                            map_fn=example_mapper(True, image_size=SIZE, dtype=tf.bfloat16))
    images, labels = next(iter(ds))
    assert images.shape == (2, SIZE, SIZE, 3) and images.dtype == tf.bfloat16
    assert labels.shape == (2,) and set(labels.numpy()) <= set(range(6))

    ds, _ = read_dataset(tmp_path / "ds", batch_size=4, training=False,
                         map_fn=example_mapper(False, image_size=SIZE))
    labels = np.concatenate([label.numpy() for _, label in ds])
    assert sorted(labels) == list(range(6))

    renamed = tf.data.Dataset.from_tensor_slices(
        {"jpeg": [e["image"] for e in examples], "class": [int(e["label"]) for e in examples]})
    mapped = renamed.map(example_mapper(False, image_size=SIZE, image_key="jpeg", label_key="class"))
    for (image, label), example in zip(mapped, examples):
        expected, _ = eval_preprocess(example["image"], 0, image_size=SIZE)
        np.testing.assert_array_equal(image.numpy(), expected.numpy())
        assert label.numpy() == example["label"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_synthetic_dataset_repeats_one_batch(dtype):
    ds = synthetic_dataset(4, image_size=SIZE, num_classes=10, dtype=dtype, seed=1)
    assert ds.cardinality() == tf.data.INFINITE_CARDINALITY
    batches = list(ds.take(3))
    for images, labels in batches:
        assert images.shape == (4, SIZE, SIZE, 3) and images.dtype == dtype
        assert labels.shape == (4,) and labels.dtype == tf.int32
        np.testing.assert_array_equal(images.numpy(), batches[0][0].numpy())
        np.testing.assert_array_equal(labels.numpy(), batches[0][1].numpy())
    values = batches[0][0].numpy().astype(np.float32)
    assert abs(values.mean()) < 0.1 and 0.5 < values.std() < 1.5 and np.abs(values).max() <= 2
    assert set(batches[0][1].numpy()) <= set(range(10))
    other, _ = next(iter(synthetic_dataset(4, image_size=SIZE, dtype=dtype, seed=2)))
    assert not np.array_equal(other.numpy(), batches[0][0].numpy())


def test_undecodable_images_raise():
    jpeg = encode(pattern(), "jpeg")
    bad = [b"definitely not an image", b"", jpeg[:100], b"\x89PNG\r\n\x1a\n" + b"\0" * 40]
    for data in bad:
        for preprocess in (train_preprocess, eval_preprocess):
            with pytest.raises(tf.errors.InvalidArgumentError):
                preprocess(data, 0, image_size=SIZE)
    with pytest.raises(tf.errors.InvalidArgumentError):
        eval_preprocess(jpeg[: len(jpeg) // 2], 0, image_size=SIZE)  # truncated mid-image
    ds = tf.data.Dataset.from_tensor_slices({"image": [jpeg, b"garbage"], "label": [0, 1]})
    it = iter(ds.map(example_mapper(True, image_size=SIZE)))
    next(it)
    with pytest.raises(tf.errors.InvalidArgumentError):
        next(it)
    with pytest.raises(ValueError, match="dtype"):
        train_preprocess(jpeg, 0, dtype=tf.int32)
