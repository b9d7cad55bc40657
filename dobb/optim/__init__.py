"""The optimizers: Dobb, and the baselines it is compared against.

The driver every matrix optimizer runs on is ``base`` (``MatrixOptimizer``) with the
contract of its parts in ``parts``; each optimizer is a module with its maths, its core and
its class: ``dobb`` (with ``dobb_core``, its maths, and ``dobb_steps``, its placement),
``muon``, ``muonbp``, ``normuon``, ``dion2``, ``nordion2``, ``dion`` (with ``dion_core`` and
``dion_sharded``); ``owner_groups`` is the owner-exchange placement of Muon's family,
``scalar`` AdamW and Lion for the other parameters, ``config`` the options. The package
imports none of them: ``dobb`` (the package) exports the classes and ``dobb.registry``
builds any of them by name.
"""
