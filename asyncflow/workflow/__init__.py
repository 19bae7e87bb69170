"""Roles and the driver loop.

A role is a plain class (it never imports Ray) with ``poll(timeout) -> int``: pull one
micro-batch of rows from the data plane, compute, put new fields back. ``run(stop)``
repeats ``poll`` in a loop (stream/async modes); the sync mode calls ``poll`` phase by
phase instead. Roles are hosted by a :class:`~asyncflow.workflow.worker.Worker`, one per
process; the launcher decides where workers live. The driver loop is in ``driver.py``.
"""
