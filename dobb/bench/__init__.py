"""Benchmarks: optimizer-call timing, communication accounting, a cost model, reports.

Each module is runnable, e.g. ``python -m dobb.bench.comm --world 4``.
"""
