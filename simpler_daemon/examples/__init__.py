"""Example callables, allow-listed by the default ``callables.allowed_modules``.

``simpler_daemon.examples.tasks`` holds SUB callables (``fn(args)``) and an
orchestration function that the README, ``simplerctl`` and the tests use.
"""
