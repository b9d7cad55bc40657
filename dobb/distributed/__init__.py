"""What the optimizers need to run on many ranks, one job per module.

- ``placement``: which part of a matrix a rank holds (``MatrixPlacement``, read from DTensor
  placements) and optimizer state laid out like the matrix's columns.
- ``groups``: the optimizers' process-group arguments (``stats_group``, ``replica_group``,
  ``sync_group``), what each means, and the one check of them.
- ``reduce``: many small tensors summed or averaged over their process groups in a few
  batched all-reduces.
- ``exchange``: whole matrices gathered to one owner rank each and the results scattered
  back (Muon's family).
- ``sharding``: Dobb's input blocks on a column shard, and per-block work shared out over
  ranks.

The DTensor types come from ``dobb._dtensor``; nothing here imports from ``dobb.optim``.
"""
