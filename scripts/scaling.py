"""Thin wrapper for a checkout: `python scripts/scaling.py ...` is `tfdist-scaling ...`
(tfdist.benchmark.scaling; see its docstring and README, "Benchmarks")."""

from tfdist.benchmark.scaling import main

if __name__ == "__main__":
    main()
