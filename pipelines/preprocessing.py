"""ImageNet preprocessing for ResNet50: random-crop training, center-crop evaluation, synthetic input.

```python
import tensorflow as tf
from tfdist.pipelines import read_dataset
from tfdist.pipelines.preprocessing import example_mapper
ds, plan = read_dataset("/scratch/imagenet-train", batch_size=256, training=True,
                        augment_fn=example_mapper(training=True, dtype=tf.bfloat16))
```

Images arrive as encoded JPEG (or PNG) bytes. Training crops a random region of 8%-100% of the
image area with aspect ratio 3/4-4/3; for JPEG only that region is decoded. Evaluation resizes the
shorter side to `image_size / crop_fraction` and keeps the central `image_size` square.

Normalisation convention (both modes): RGB channel order, pixel values 0-255 first, then
`(pixel - IMAGENET_MEAN_RGB) / IMAGENET_STD_RGB` per channel, so a pixel of the ImageNet mean
colour becomes 0 and the data has roughly unit scale. Images are HWC per example (NHWC once
batched), in `dtype` (float32, bfloat16 or float16), cast after all arithmetic in float32.

An image that cannot be decoded raises `tf.errors.InvalidArgumentError` (eagerly, or when the
dataset is iterated); nothing is skipped or replaced. One limit of decoding only the crop: a JPEG
truncated after the crop's last row yields that crop (its true pixels) without an error; evaluation
decodes whole images and always raises.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

IMAGENET_MEAN_RGB = (123.68, 116.78, 103.94)
IMAGENET_STD_RGB = (58.393, 57.12, 57.375)
OUTPUT_DTYPES = (tf.float32, tf.bfloat16, tf.float16)

AREA_RANGE = (0.08, 1.0)
ASPECT_RATIO_RANGE = (3 / 4, 4 / 3)
MIN_OBJECT_COVERED = 0.1  # of the whole-image box, as in the reference ResNet pipelines
MAX_ATTEMPTS = 10
EVAL_CROP_FRACTION = 0.875


def _output_dtype(dtype):
    dtype = tf.dtypes.as_dtype(dtype)
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be one of {[d.name for d in OUTPUT_DTYPES]}, got {dtype.name}")
    return dtype


def normalize(image: tf.Tensor, dtype: tf.dtypes.DType | str = tf.float32) -> tf.Tensor:
    """`(image - mean) / std` per RGB channel for an image with values 0-255, cast to `dtype`.

    Args:
        image: RGB pixels 0-255, channels last (any numeric dtype).
        dtype: the result's dtype: float32, bfloat16 or float16.

    Returns:
        The normalised image, in `dtype`.

    Raises:
        ValueError: `dtype` is not one of those three.
    """
    dtype = _output_dtype(dtype)
    image = tf.cast(image, tf.float32)
    image = (image - tf.constant(IMAGENET_MEAN_RGB)) / tf.constant(IMAGENET_STD_RGB)
    return tf.cast(image, dtype)


def _center_box(shape, fraction):
    """[y, x, height, width] of the central square spanning `fraction` of the shorter side."""
    height, width = shape[0], shape[1]
    side = tf.cast(fraction * tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
    side = tf.maximum(side, 1)
    return tf.stack([(height - side) // 2, (width - side) // 2, side, side])


def _random_box(shape, seed):
    """[y, x, height, width] of a random crop; a center crop when sampling finds none."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        seed=seed,
        min_object_covered=MIN_OBJECT_COVERED,
        aspect_ratio_range=ASPECT_RATIO_RANGE,
        area_range=AREA_RANGE,
        max_attempts=MAX_ATTEMPTS,
        use_image_if_no_bounding_boxes=True,
    )
    # After MAX_ATTEMPTS failures the op returns the whole image, which would only be squashed to
    # a square; a center crop keeps the aspect ratio instead.
    failed = tf.reduce_all(tf.equal(size[:2], shape[:2]))
    sampled = tf.concat([begin[:2], size[:2]], axis=0)
    return tf.where(failed, _center_box(shape, EVAL_CROP_FRACTION), sampled)


def _decode_random_crop(image_bytes, seed):
    """The uint8 RGB pixels of a random crop; JPEG decodes only the cropped region."""
    image_bytes = tf.convert_to_tensor(image_bytes, tf.string)

    def jpeg():
        box = _random_box(tf.image.extract_jpeg_shape(image_bytes), seed)
        return tf.image.decode_and_crop_jpeg(image_bytes, box, channels=3)

    def other():
        image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
        y, x, height, width = tf.unstack(_random_box(tf.shape(image), seed))
        return image[y:y + height, x:x + width, :]

    return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


def train_preprocess(image_bytes: tf.Tensor, label: tf.Tensor, *, image_size: int = 224,
                     dtype: tf.dtypes.DType | str = tf.float32) -> tuple[tf.Tensor, tf.Tensor]:
    """Random crop, random horizontal flip, bilinear resize, normalise: ((H, W, 3) image, label).

    Randomness follows TF's global and op seeds (`tf.random.set_seed`). See the module docstring
    for the normalisation.

    Args:
        image_bytes: one encoded JPEG or PNG (scalar string tensor).
        label: returned unchanged.
        image_size: the output's height and width.
        dtype: the image's dtype: float32, bfloat16 or float16.

    Returns:
        `(image, label)`: the image `[image_size, image_size, 3]` in `dtype`.

    Raises:
        ValueError: `dtype` is not one of those three.
    """
    dtype = _output_dtype(dtype)
    # The stateful sampling op ignores tf.random.set_seed in eager mode once its kernel exists;
    # stateless ops fed by one stateful draw follow the global seed everywhere.
    crop_seed, flip_seed = tf.unstack(tf.random.uniform([2, 2], maxval=tf.int32.max, dtype=tf.int32))
    image = _decode_random_crop(image_bytes, crop_seed)
    image = tf.image.resize(image, [image_size, image_size], method="bilinear")
    # Flipping after the resize gives the same pixels (the resize is mirror-symmetric), on fewer.
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return normalize(image, dtype), label


def eval_preprocess(image_bytes: tf.Tensor, label: tf.Tensor, *, image_size: int = 224,
                    dtype: tf.dtypes.DType | str = tf.float32,
                    crop_fraction: float = EVAL_CROP_FRACTION) -> tuple[tf.Tensor, tf.Tensor]:
    """Resize the shorter side to image_size / crop_fraction, center crop, normalise: (image, label).

    Deterministic.

    Args:
        image_bytes: one encoded JPEG or PNG (scalar string tensor).
        label: returned unchanged.
        image_size: the output's height and width.
        dtype: the image's dtype: float32, bfloat16 or float16.
        crop_fraction: the central crop's share of the resized shorter side, in (0, 1].

    Returns:
        `(image, label)`: the image `[image_size, image_size, 3]` in `dtype`.

    Raises:
        ValueError: `dtype` is not one of those three, or `crop_fraction` is out of range.
    """
    dtype = _output_dtype(dtype)
    if not 0 < crop_fraction <= 1:
        raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
    resize_to = round(image_size / crop_fraction)
    image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
    shape = tf.shape(image)[:2]
    scale = resize_to / tf.cast(tf.reduce_min(shape), tf.float32)
    new_shape = tf.cast(tf.round(tf.cast(shape, tf.float32) * scale), tf.int32)
    new_shape = tf.maximum(new_shape, resize_to)  # float rounding must not leave a side short
    image = tf.image.resize(image, new_shape, method="bilinear")
    y, x = (new_shape[0] - image_size) // 2, (new_shape[1] - image_size) // 2
    image = image[y:y + image_size, x:x + image_size, :]
    image = tf.ensure_shape(image, [image_size, image_size, 3])
    return normalize(image, dtype), label


def example_mapper(training: bool, image_size: int = 224, dtype: tf.dtypes.DType | str = tf.float32,
                   image_key: str = "image", label_key: str = "label",
                   ) -> Callable[[dict[str, tf.Tensor]], tuple[tf.Tensor, tf.Tensor]]:
    """A function mapping a parsed example dict to (image, label), for `read_dataset(map_fn=...)`.

    The dict is what `pipelines.read_dataset` yields per record: encoded image bytes under
    `image_key`, an integer class under `label_key` (returned unchanged).

    Args:
        training: `train_preprocess` (random crop and flip) if True, else `eval_preprocess`.
        image_size: the images' height and width.
        dtype: the images' dtype: float32, bfloat16 or float16.
        image_key: the feature holding the encoded image.
        label_key: the feature holding the label.

    Returns:
        `map_example(example) -> (image, label)`.
    """
    preprocess = train_preprocess if training else eval_preprocess

    def map_example(example):
        return preprocess(example[image_key], example[label_key], image_size=image_size, dtype=dtype)

    return map_example


def synthetic_dataset(batch_size: int, *, image_size: int = 224, num_classes: int = 1000,
                      dtype: tf.dtypes.DType | str = tf.float32, seed: int = 0) -> tf.data.Dataset:
    """An infinite dataset repeating one random batch: (images [N, H, W, 3] in dtype, int32 labels).

    For benchmarks: it measures compute only (plus copying the batch to the device each step),
    with no I/O, decoding or augmentation. The batch is generated once, from `seed`; images are
    normal values truncated at +-2, about the scale of normalised real images.

    Args:
        batch_size: images per batch (per rank).
        image_size: the images' height and width.
        num_classes: labels are drawn from 0 to `num_classes - 1`.
        dtype: the images' dtype: float32, bfloat16 or float16.
        seed: the seed the batch is generated from.

    Returns:
        The dataset of `(images, labels)` batches.

    Raises:
        ValueError: `dtype` is not one of float32, bfloat16 or float16.

    Example:
        ```python
        import tensorflow as tf
        from tfdist.pipelines.preprocessing import synthetic_dataset
        images, labels = next(iter(synthetic_dataset(8, image_size=32, dtype=tf.bfloat16)))
        print(images.shape, images.dtype, labels.dtype)   # (8, 32, 32, 3) bfloat16 int32
        ```
    """
    dtype = _output_dtype(dtype)
    images = tf.random.stateless_truncated_normal([batch_size, image_size, image_size, 3], seed=[seed, 0])
    labels = tf.random.stateless_uniform(
        [batch_size], seed=[seed, 1], minval=0, maxval=num_classes, dtype=tf.int32)
    batch = (tf.cast(images, dtype), labels)
    return tf.data.Dataset.from_tensors(batch).repeat().prefetch(tf.data.AUTOTUNE)
