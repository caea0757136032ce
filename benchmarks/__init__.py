"""Measurements of dlmjax beside its peers: sweeps, microbenchmarks, peer comparisons.

Not part of the installed package: run them from the repository root, e.g.
`python -m benchmarks.sampler --help`. docs/benchmarks.md gives each one's current figure.
"""
