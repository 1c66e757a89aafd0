"""The Scheduler: the single owner of endpoint progress.

It publishes work into the lanes, polls them, drains completions and releases
dependents, one round at a time (``dispatch.py`` draws the round). One object, built
as a stack of classes, each in its own module and each over the one before::

    SchedulerState   state.py       the queues (partitioned by run), admission, stats,
                                    the lanes list, the loop's wake-up future
    RunCompletion    completion.py  what happens when a task or a run ends
    ProgressLoop     progress.py    the coroutine: spin or park, child exits, dead lanes
    Scheduler        dispatch.py    the dispatch rules and one round

Which module owns which state (nothing else writes it):

============== =================================================================
module         owns
============== =================================================================
runmodel.py    a run and its slots: ``Run``, ``TaskSlot`` (states, dependencies,
               results), ``TensorMap``, the ``fifo`` ``Admission``
fair.py        the ``fair`` admission: per-client shares, stride passes
lanes.py       one ``WorkerThread`` per endpoint (its active and staged dispatch),
               the ``WorkerManager`` that holds them by type and worker id
state.py       the queues, the admission object, stats, suspect and withdrawn
               dispatches, the callbacks the engine sets (``on_admit``,
               ``on_task_event``, ``on_lane_dead``)
dispatch.py    reload holds (digests held back), the round's own bookkeeping
subpump.py     the C pump's per-lane records and its spin hit rate
spingate.py    the spin-or-park decision of the coroutine and of waiting callers
driver.py      who runs rounds (the caller's thread, the background thread, or
               one bound event loop) and the lock that keeps it one at a time
auxloop.py     the blocking API's auxiliary loop and the tasks left on it
sink.py        no state: the narrow interfaces the engine sees
============== =================================================================

Seams, the only calls that cross a module boundary by contract:

* the engine submits through ``sink.SubmitSink`` (an ``Orchestrator``) and moves a
  run through its life with ``sink.RunControl`` (``engine/runs.py``);
* the SUB pump (``subpump.py``) hands its bulk bookkeeping back through
  ``subpump.PumpSink`` (``claim_published``, ``complete_pumped``);
* the C SUB pump reads the ``TaskSlot`` fields listed in
  ``runmodel.PUMP_SLOT_FIELDS`` (and in ``mailbox/_mailbox_pump.c``);
* the driver calls ``Scheduler.round``, ``fail_all`` and reads ``in_round``.
"""
