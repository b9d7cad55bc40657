"""What the optimizers need to run on many ranks, one job per module: ``placement`` (which
part of a matrix a rank holds), ``groups`` (the process-group arguments), ``reduce``
(batched all-reduces), ``exchange`` (whole matrices to owner ranks), ``sharding`` (Dobb's
blocks on a column shard). Nothing here imports from ``dobb.optim``.
"""
