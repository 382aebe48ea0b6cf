"""What Horovod's reduce-scatter must give on every rank: the inputs tests/multirank/reducescatter_checks.py
sends from each rank, and numpy's sum of them split as Horovod splits it.

`check(ranks)` compares every rank's results ({rank: reducescatter_checks() dict}) with numpy's:
exactly for integer-valued inputs (every order of summation gives the same), within 1e-5 for
random float32 values. The same launch checks Gloo's allgather and alltoall (patch 0013 reorders
their sends and receives): `gather_inputs` and `check_gathers`; and its allreduce of small inputs
(patch 0018: one exchange, every rank reducing in rank order): `small_allreduce_inputs` and
`check_small_allreduces`.
"""

import numpy as np

ALONE = ("large", "uneven", "fewer_rows", "half", "double", "int", "normal")
GROUPED = ("grouped_a", "grouped_b", "grouped_c")


def rank_inputs(rank, size):
    """{name: array} this rank reduce-scatters; the same shapes on every rank."""
    rng = np.random.default_rng(500 + rank)

    def integers(shape, dtype, bound=100):
        return rng.integers(-bound, bound + 1, size=shape).astype(dtype)

    return {
        "large": integers((size * 1_300_001,), np.float32),  # each segment: 5 ring pieces of 1 MiB, 4 in flight
        "uneven": integers((2 * size + 1, 1000), np.float32),  # the first ranks get one row more
        "fewer_rows": integers((size - 1, 3), np.float32),  # the last rank gets no row
        "half": integers((size * 5 + 2, 7), np.float16, bound=20),
        "double": integers((size * 3, 2, 2), np.float64),
        "int": integers((size * 4 + 3,), np.int32, bound=10_000),
        "normal": rng.normal(size=(size * 50_000,)).astype(np.float32),
        "grouped_a": integers((size * 400_000,), np.float32),
        "grouped_b": integers((size + 1, 5), np.float32),
        "grouped_c": integers((size * 2, 3), np.float32),
    }


def expected_share(inputs_by_rank, name, rank):
    """numpy's sum over ranks of `name`, split on its first dimension as Horovod splits it."""
    total = np.sum([inputs[name].astype(np.float64) for inputs in inputs_by_rank], axis=0)
    return np.array_split(total, len(inputs_by_rank))[rank]


def check(ranks):
    """Every rank's share of every case equals numpy's. `ranks`: {rank: reducescatter_checks() dict}."""
    size = len(ranks)
    inputs_by_rank = [rank_inputs(r, size) for r in range(size)]
    for rank, got in ranks.items():
        for name in ALONE + GROUPED:
            want = expected_share(inputs_by_rank, name, rank)
            mine = np.array(got[name], dtype=np.float64).reshape(want.shape)
            assert got[f"dtype:{name}"] == inputs_by_rank[0][name].dtype.name, (name, rank)
            if name == "normal":
                np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-5, err_msg=f"{name}, rank {rank} of {size}")
            else:
                np.testing.assert_array_equal(mine, want, err_msg=f"{name}, rank {rank} of {size}")


def gather_inputs(rank, size):
    """(allgather input, alltoall input, alltoall splits) of `rank`: rows of 1,000 values that
    name their sender, receiver and row; a different row count from each rank and to each rank,
    with some blocks of 3 MB (several socket buffers) and one empty block."""
    gather_rows = 800 * (rank + 1)
    splits = [(rank + 2 * j) % 3 * 400 for j in range(size)]
    splits[(rank + 1) % size] += 1

    def rows(count, sender, receiver):
        return (sender * 1e6 + receiver * 1e4 + np.arange(count)[:, None] + np.zeros((1, 1000))).astype(np.float32)

    to_all = np.concatenate([rows(n, rank, j) for j, n in enumerate(splits)])
    return rows(gather_rows, rank, size), to_all, splits


def rows_summary(array):
    """A received [rows, 1000] array, small enough for the results file: each row's first and last
    value and its float64 sum (a row holds one value 1,000 times)."""
    array = np.asarray(array)
    return {"first": array[:, 0].tolist(), "last": array[:, -1].tolist(),
            "sums": array.astype(np.float64).sum(axis=1).tolist()}


def check_gathers(ranks):
    """Every rank received every rank's rows, in rank order. `ranks`: {rank: reducescatter_checks() dict}."""
    size = len(ranks)
    inputs = [gather_inputs(r, size) for r in range(size)]
    gathered = rows_summary(np.concatenate([i[0] for i in inputs]))
    for rank, got in ranks.items():
        assert got["allgather"] == gathered, f"allgather, rank {rank} of {size}"
        blocks = [np.split(i[1], np.cumsum(i[2])[:-1])[rank] for i in inputs]
        assert got["alltoall"] == rows_summary(np.concatenate(blocks)), f"alltoall, rank {rank} of {size}"
        assert got["alltoall_received_splits"] == [len(b) for b in blocks], rank


DIRECT_BYTES = 256 * 1024  # patch 0018's default: the largest input times (ranks - 1) allreduced directly


def small_allreduce_inputs(rank, size):
    """{name: (array, op)} this rank allreduces: small ones (one exchange) and one just over the limit (the ring)."""
    rng = np.random.default_rng(900 + rank)
    ring_elements = DIRECT_BYTES // (4 * (size - 1)) + 1000
    return {
        "normal": (rng.normal(size=1000).astype(np.float32), "sum"),
        "double": (rng.normal(size=(30, 10)), "sum"),
        "int": (rng.integers(-10_000, 10_000, size=500).astype(np.int32), "sum"),
        "max": (rng.normal(size=700).astype(np.float32), "max"),
        "grouped_a": (rng.normal(size=300).astype(np.float32), "sum"),
        "grouped_b": (rng.normal(size=(20, 3)).astype(np.float32), "sum"),
        "ring": (rng.normal(size=ring_elements).astype(np.float32), "sum"),
    }


def check_small_allreduces(ranks):
    """Small allreduces: on every rank exactly the inputs reduced in rank order (x0 + x1 + ...), in
    their dtype; the one over the limit within float32 rounding, and (3 ranks or more) not that."""
    size = len(ranks)
    inputs = [small_allreduce_inputs(r, size) for r in range(size)]
    for name, (first, op) in inputs[0].items():
        ordered = first.copy()
        for other in inputs[1:]:
            ordered = np.maximum(ordered, other[name][0]) if op == "max" else ordered + other[name][0]
        for rank, got in ranks.items():
            mine = np.array(got[name], dtype=first.dtype).reshape(first.shape)
            if name != "ring":
                np.testing.assert_array_equal(mine, ordered, err_msg=f"{name}, rank {rank} of {size}")
            else:
                np.testing.assert_allclose(mine, ordered, rtol=1e-5, atol=1e-5, err_msg=f"ring, rank {rank} of {size}")
            assert got[name] == ranks[0][name], f"{name}: rank {rank} differs from rank 0"
        if name == "ring" and size > 2:  # the ring sums each piece in another order
            assert not np.array_equal(np.array(ranks[0][name], dtype=np.float32), ordered), "ring"
