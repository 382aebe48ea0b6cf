"""Argparse types for tfdist's console scripts: numbers checked at parse time, before TensorFlow loads.

    parser.add_argument("--num_batches", type=argtypes.positive_int, default=10)
    parser.add_argument("--bandwidth_gbit", type=argtypes.positive_float)

A bad value ends the command at once with argparse's usage line and a message naming the flag,
the value and what is expected (`argument --num_batches: -3 is not a positive integer (>= 1)`),
instead of running forever or failing later inside TensorFlow. No imports beyond the standard
library, so a command's `--help` and its argument errors stay instant.
"""

import argparse
import math


def _number(text, kind, convert):
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}")
    return value


def positive_int(text):
    """An integer >= 1."""
    value = _number(text, "an integer", int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (>= 1)")
    return value


def nonnegative_int(text):
    """An integer >= 0."""
    value = _number(text, "an integer", int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: expected an integer >= 0")
    return value


def positive_float(text):
    """A finite number > 0."""
    value = _number(text, "a finite number", float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not positive: expected a number > 0")
    return value


def nonnegative_float(text):
    """A finite number >= 0."""
    value = _number(text, "a finite number", float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} is negative: expected a number >= 0")
    return value


def fraction(text):
    """A number in (0, 1], e.g. an accuracy."""
    value = _number(text, "a finite number", float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} is not in (0, 1]: expected a fraction such as 0.9")
    return value
