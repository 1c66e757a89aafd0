"""The in-process engine: the ``Worker`` and what it composes.

``worker.py`` is the facade; ``lifecycle.py`` its states, init and close;
``pool.py`` the child pool (fork, start-up barrier, rollback, replacement);
``registration.py`` callables installed on every target child; ``runs.py`` a run's
life between the facade and the Scheduler, ``handle.py`` the ``RunHandle`` a caller
holds, ``orchestrator.py`` the ``Orchestrator`` an orchestration function receives;
``local_l3.py`` and ``remote_l3.py`` a level-4 Worker's local and remote L3 children,
``remote_api.py`` the Worker's remote-buffer API over them.
"""
