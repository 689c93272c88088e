"""The fixed GPU training benchmark (``ctrain bench``): the seeds' SFT settings against ctrain's fast path.

See docs/benchmarks.md for the problem, the metric and the measured numbers.
"""
