"""Thin wrapper for a checkout: `python scripts/benchmark.py ...` is `tfdist-benchmark ...`
(tfdist.benchmark.train_benchmark; see its docstring and README, "Benchmarks")."""

from tfdist.benchmark.train_benchmark import main

if __name__ == "__main__":
    main()
