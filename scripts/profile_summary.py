"""Thin wrapper for a checkout: `python scripts/profile_summary.py ...` is `tfdist-profile ...`
(tfdist.benchmark.profile_summary; see its docstring and README, "Profiling")."""

from tfdist.benchmark.profile_summary import main

if __name__ == "__main__":
    main()
