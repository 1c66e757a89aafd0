"""Helpers the tests import; pytest collects nothing here (no ``test_*.py`` file).

Callables run by children, one module per audience:

* ``sub_tasks``: SUB callables the in-process engine tests run (Worker, Scheduler,
  endpoints, child loops, nested local L3s), with ``targs`` to build their arguments;
* ``chip_kernels``: chip kernels, registered by path;
* ``daemon_tasks``: callables the daemon, client and ops tests register by import path
  in a real ``simpler-daemon``;
* ``l3_jobs``: L3 orchestrations a remote session runner or a local L3 child runs by
  import path;
* ``crash_tasks``: the crash table's misbehaving task, kernel and orchestration;
* ``slow_import``, ``rendezvous_import``: modules whose import is the point (slow, or a
  rendezvous of several children); the test process never imports them.

Rigs: ``worker_pool`` (the one ``Pool``: a started Worker with its helper handles),
``endpoint_rig`` (one SUB child behind a hand-built endpoint), ``chip_endpoint_rig`` (one
chip child behind one), ``chip_worker_rig`` (a Worker with chip children and a recorder
of its Scheduler's events), ``scheduler_rig`` (a Scheduler over in-memory lanes),
``submit_sink`` (what an Orchestrator submits to), ``nested_rig`` (L4 Workers over local
L3 children).

Harnesses: ``daemon_harness`` (a real ``simpler-daemon``), ``remote_harness`` (real
remote-worker processes on test hosts: network namespaces, or loopback aliases), ``remote_worker``
(``simpler-remote-worker`` processes on this host), ``two_clients`` (a second client
identity over TCP), ``ctl`` (``simplerctl`` run in this process) and ``users`` (a
throwaway system user).
"""
