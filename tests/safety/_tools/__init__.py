"""Reusable pieces of the safety suite: resource, workers, checkers, faults, proxy.

Every module here runs in the test process and, for ``resource`` and ``worker``, as a
separate process too (``python -m safety._tools.worker`` with ``tests/`` on the path).
All times are ``time.monotonic()`` (``CLOCK_MONOTONIC``, one clock for every process of
the host), so histories of different processes can be compared.
"""
