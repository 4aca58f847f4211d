"""Framework adapters, installed as ``cbs_tracker.integrations``.

Each adapter imports its framework lazily, so the core package needs only torch
and numpy.
"""
