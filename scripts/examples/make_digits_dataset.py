"""Write scikit-learn's 8x8 handwritten digits as an image TFRecord dataset (train/ and test/).

    python scripts/examples/make_digits_dataset.py /tmp/digits
    horovodrun -np 2 --gloo tfdist-benchmark --model mnist_cnn --image_size 32 --num_classes 10 \\
        --data_dir /tmp/digits/train --eval_dir /tmp/digits/test --epochs 30 --target_accuracy 0.9

Real data with no download, for accuracy and time-to-accuracy runs of tfdist-benchmark: 1,797
digits, split 80/20 (stratified, fixed seed), each upscaled to 32x32 RGB and stored as PNG bytes with
an int64 label, through `pipelines.write_examples` (so the reader's sharding and checks apply).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from tfdist.pipelines import write_examples  # noqa: E402


def png_examples(images, labels, size):
    for image, label in zip(images, labels):
        pixels = tf.image.resize(image[..., None] * (255.0 / 16.0), [size, size], method="bilinear")
        rgb = tf.cast(tf.round(tf.tile(pixels, [1, 1, 3])), tf.uint8)
        yield {"image": tf.io.encode_png(rgb).numpy(), "label": np.int64(label)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--size", type=int, default=32, help="stored image side")
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images.astype("float32"), digits.target, test_size=0.2, random_state=0, stratify=digits.target)
    names = [str(d) for d in range(10)]
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        manifest = write_examples(png_examples(x, y, args.size), os.path.join(args.out_dir, split),
                                  min_shards=args.shards, class_names=names)
        print(f"{split}: {manifest.records} records in "
              f"{len(manifest.shards)} shards at {manifest.directory}")


if __name__ == "__main__":
    main()
