"""The per-host SPMD worker: one process of one `jax.distributed` group, training one segment.

Runs the same under a Ray host actor, in a bare process without Ray (`python -m
orchestrator.worker SPEC.json`, as on a GPU machine) or in a test. Imports no Ray.
"""
