"""Adapters to training frameworks, each behind an optional extra.

``dobb.integrations.torchtitan`` (``pip install "dobb[torchtitan]"``): an
``OptimizersContainer`` and config functions for torchtitan. Importing this package imports
no framework; each adapter imports its framework when it is imported itself.
"""
