"""Generated gRPC code for the ``atoll.v1`` protocol (see ``coordinator.proto``).

Regenerate with ``python -m atoll.protos.generate``; ``tests/test_protos.py`` fails when the
checked-in files are stale.
"""
