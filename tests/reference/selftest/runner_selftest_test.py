"""The reference runner's own check (tests/test_reference_suite.py runs it with `--suite selftest`).

Three tests, in order, on every rank: the first passes; in the second, rank 1 fails before the
collective that rank 0 then waits in forever (the runner must name it "hung" and go on); in the
third, rank 1's process dies (the runner must name it "crashed" and go on); the fourth passes,
which only a relaunch after the hang and the crash can reach.
"""

import os

import tensorflow as tf


def _rank():
    return int(os.environ["HOROVOD_RANK"])


def test_1_passes():
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])  # the runner swaps in HorovodStrategy
    assert float(strategy.reduce("SUM", tf.constant(1.0), axis=None)) == strategy.num_replicas_in_sync


def test_2_leaves_rank_0_waiting():
    strategy = tf.distribute.MirroredStrategy()
    if _rank() == 1:
        raise AssertionError("rank 1 fails before the collective")
    strategy.reduce("SUM", tf.constant(1.0), axis=None)


def test_3_rank_1_dies():
    if _rank() == 1:
        os._exit(9)


def test_4_passes_after_both():
    strategy = tf.distribute.MirroredStrategy()
    assert float(strategy.reduce("SUM", tf.constant(2.0), axis=None)) == 2.0 * strategy.num_replicas_in_sync
