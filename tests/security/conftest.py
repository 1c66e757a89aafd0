"""Fixtures of the hardening tests: ``start_worker`` starts a real ``simpler-remote-worker``
on loopback (``token_file`` is its token), from tests/support/remote_worker.py."""

from tests.support.remote_worker import start_worker, token_file  # noqa: F401  (fixtures)
