"""Benchmarks: optimizer-call timing, communication accounting, a cost model, reports.

Each module is runnable, e.g. ``python -m bench.results.comm --world 4``.
"""
