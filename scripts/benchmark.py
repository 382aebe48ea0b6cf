"""Thin wrapper for a checkout: `python scripts/benchmark.py ...` is `tfdist-benchmark ...`
(tfdist.benchmark.run; see its docstring and README, "Benchmarks")."""

from tfdist.benchmark.run import main

if __name__ == "__main__":
    main()
