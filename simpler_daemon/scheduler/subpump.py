"""The SUB fast loop: the Scheduler's per-task path for SUB lanes, in C.

For one run's SUB queue, ``_mailbox.sub_pump`` polls every eligible SUB lane's task
frame, completes what finished plainly, publishes the next ready slot of the queue
and wakes the child, in one call (``docs/mailbox.md``, *Single-frame path*)::

    Scheduler round
      SubPump.pump(run, queue)        lanes: IDLE, or running a task the pump published
        sub_pump (C)                  poll -> complete -> take queue head -> publish
      sync the lanes                  the task still in flight becomes the lane's
                                      dispatch, exactly as if Python had published it
      claim + complete in bulk        RUNNING, counts, fair charge, events, results,
                                      the Scheduler's spin-gate samples (spingate.py)

The Scheduler keeps every policy: it picks the run (the fifo head, or the only run
with SUB work under ``fair``), calls the pump only while no reload holds a digest,
and handles everything unusual on its Python path. The pump stops at a slot that is
not READY or is a group (the Python dispatch takes it), and leaves a frame that did
not end plainly (an error, a stale trailer, an oversized result) to the lane's Python
``progress``. After each call the task a lane still runs is that lane's ordinary
``WorkerDispatch`` (its frame, deadline and child watch as ``submit_progress`` sets
them), so a crash, a ``terminate``, a deadline or a round without the pump finds
the usual state.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Final, Protocol

from simpler_daemon.endpoints.base import EndpointEvent, WorkerDispatch
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.layout import OFF_STATE, TASK_FRAMES, MailboxState
from simpler_daemon.scheduler.runmodel import SlotState

if TYPE_CHECKING:
    from simpler_daemon.scheduler.lanes import WorkerThread
    from simpler_daemon.scheduler.runmodel import Run, TaskSlot
    from simpler_daemon.scheduler.spingate import SpinGate

__all__ = ["PUMP_CHAIN_S", "PUMP_MAX_PUBLISH", "PUMP_SPIN_NS", "PumpSink", "SubPump"]

#: How long one pump call waits for a child to finish with nothing else to do (ns):
#: an empty task's round trip fits, a longer task returns to the Scheduler (which
#: spins or parks as usual). The GIL is held meanwhile, so keep it short.
PUMP_SPIN_NS: Final = 50_000
#: Most slots one call publishes: bounds how long a round keeps the GIL.
PUMP_MAX_PUBLISH: Final = 128
#: How long one round goes on calling the pump while its completions ready the head of
#: the queue (``SubPump.drive``: a dependency chain, or a queue longer than one call
#: publishes): the driver looks at other threads and the other lanes between rounds.
PUMP_CHAIN_S: Final = 0.0005
#: The pump spins while at least this share of its spinning calls saw a task finish
#: (smoothed): for tasks longer than the spin, spinning would only take a core from the
#: children (tasks of 500 µs of CPU, say). A hit *rate*, not a mean latency: the rare slow
#: completion of a loaded machine does not turn spinning off.
PUMP_MIN_HIT_RATE: Final = 0.5
#: A spinning call is a hit when it took at most this long (s) per completion it caught,
#: in wall time or else in the parent's CPU. The call yields the core between looks, so
#: while the children keep every core busy (500 µs tasks on a 2-core machine) a long call
#: costs little CPU per task, less than the park, wake-up and Python round per
#: completion it saves; with an idle core to spin on, CPU is wall time, and a call that
#: waited out long tasks is a miss. The CPU clock is a system call (wall time is not):
#: it is read only after a call that wall time alone judged a miss.
PUMP_HIT_S: Final = PUMP_SPIN_NS / 1e9
#: While the pump does not spin, every this many calls spin once (a probe), so spinning
#: comes back when tasks get short again: long tasks lose one spin per this many tasks.
PUMP_PROBE_EVERY: Final = 32

#: The calling thread's CPU clock (s): what a long spinning call cost.
_thread_time = time.thread_time

_SLOT: Final = 2
_DID: Final = 3
_NEXT: Final = 4
_AT: Final = 5
_STOP: Final = 6
_DONE: Final = 7
_PEER: Final = 8
assert _mb.SUBPUMP_FIELDS == 9

_READY: Final = SlotState.READY
#: A task frame's state while its task waits or runs (TASK_LAUNCHED: a queue frame's
#: child claimed it).
_RUNNING: Final = frozenset({int(MailboxState.TASK_READY), int(MailboxState.TASK_LAUNCHED)})
_TASK_READY: Final = int(MailboxState.TASK_READY)
_IDLE: Final = int(MailboxState.IDLE)


class PumpSink(Protocol):
    """What the pump needs of the Scheduler (``completion.py`` implements it): the
    bookkeeping a Python dispatch and a Python completion would have done, in bulk."""

    #: Fed the dispatch-to-completion latency of the tasks the pump completed.
    spin_gate: SpinGate
    #: Completions waiting for the Python path (a frame the pump left to ``progress``).
    completions: list[Any]

    def claim_published(self, published: list[TaskSlot]) -> None:
        """The slots the pump just published (one run) are RUNNING: counts, the fair
        charge and the task events, as a dispatch does; ``published`` is emptied."""
        ...

    def complete_pumped(self, lane: WorkerThread, done: list[Any]) -> None:
        """The tasks the pump saw end plainly on ``lane`` (a slot, or (slot, msgpack
        bytes) when it returned a value) succeeded: what a completion does."""
        ...

    def requeue_withdrawn(
        self, slot: TaskSlot, lane: WorkerThread, why: str, *, requeue: bool = True
    ) -> None:
        """``slot`` was queued on ``lane`` and taken back unstarted: queue it again."""
        ...


class _Frame:
    """One task frame of a SUB lane as the pump sees it: the C state list and the
    dispatch the pump published into it."""

    __slots__ = ("dispatch", "done_issued_at", "index", "state")

    def __init__(self, endpoint: LocalMailboxEndpoint, index: int) -> None:
        self.index = index
        #: [buf, frame_off, slot, dispatch_id, next_dispatch_id, published_ns, stop, done,
        #: peer]; ``stop`` set: the last call left this frame to the Python path
        #: (``progress``); ``done``: what it completed, in order (a slot, or (slot, bytes)
        #: for a returned value), emptied by ``round``; ``peer``: the index of the lane's
        #: other frame in the call's list (-1: none).
        self.state: list[Any] = [endpoint.buf, TASK_FRAMES[index], None, 0, 1, 0, 0, [], -1]
        #: The dispatch in flight in this frame that the pump published.
        self.dispatch: WorkerDispatch | None = None
        #: ``issued_at`` of the dispatch in flight before the last call when that call
        #: completed it (the first of the done list), else 0.0: the rest of the done list
        #: was published and completed within the call (the spin gate's samples).
        self.done_issued_at = 0.0


class _Lane:
    """One SUB lane as the pump sees it: its task frames (two with a queue frame)."""

    __slots__ = ("endpoint", "f0", "f1", "frames", "lane", "states")

    def __init__(self, lane: WorkerThread, endpoint: LocalMailboxEndpoint) -> None:
        self.lane = lane
        self.endpoint = endpoint
        self.f0 = _Frame(endpoint, 0)
        #: The queue frame, or None (``sub_queue_depth=1``).
        self.f1 = _Frame(endpoint, 1) if endpoint.queue_frame else None
        self.frames = [self.f0] if self.f1 is None else [self.f0, self.f1]
        #: The frames' C state lists, in order (added to each call's list at once).
        self.states = [fr.state for fr in self.frames]

    def holds(self, lane: WorkerThread) -> bool:
        """Whether every dispatch in flight on ``lane`` is one the pump published here.
        (Inline in ``select``: it runs for every lane on every round.)"""
        a, st = lane.active, lane.staged
        d0 = self.f0.dispatch
        f1 = self.f1
        d1 = f1.dispatch if f1 is not None else None
        return (a is None or a is d0 or a is d1) and (st is None or st is d0 or st is d1)


class SubPump:
    """Runs ``_mailbox.sub_pump`` over the SUB lanes and mirrors its effect on them.

    The per-lane steps (the eligibility test, the sync after the call, taking the done
    list) are written inline in ``select``, ``pump`` and ``round``: they run for every
    lane on every round, and a Python call each cost more than the step."""

    __slots__ = (
        "_by_cpu",
        "_calls",
        "_count",
        "_events",
        "_lanes",
        "_published",
        "_queue_ok",
        "_queued",
        "_room",
        "_states",
        "_work",
        "hit_rate",
    )

    def __init__(self) -> None:
        self._lanes: dict[int, _Lane] = {}
        #: What the current call published, in order (claimed, then cleared).
        self._published: list[TaskSlot] = []
        #: The lanes of the current call (reused).
        self._work: list[_Lane] = []
        self._states: list[list[Any]] = []
        self._events: list[EndpointEvent] = []
        #: Smoothed share of spinning calls that ended with nothing in flight or saw a
        #: task finish (``PUMP_MIN_HIT_RATE``): whether the next call spins.
        self.hit_rate = 1.0
        #: The last judged call was long in wall time: the next is timed in CPU too.
        self._by_cpu = False
        self._calls = 0
        #: Every SUB lane is in this call (``select``): only then may a task be queued
        #: behind a busy child, since none the pump cannot see is free for it.
        self._queue_ok = False
        #: A task waited in a queue frame after the last call (``rebalance`` looks).
        self._queued = False
        #: After the last call, a frame could take a task: a free lane, or (when tasks may
        #: be queued) a busy lane's free queue frame (``drive`` chains only then).
        self._room = False
        #: Tasks the last call published.
        self._count = 0

    def owns(self, lane: WorkerThread) -> bool:
        """Whether the pump polls ``lane``'s frames this round: a live local SUB lane
        running a task the pump published (and maybe one it queued behind it). The round
        polls every other busy lane on the Python path first, so a lane that frees up
        there joins the pump."""
        rec = self._lanes.get(id(lane))
        if rec is None or lane.active is None or not rec.holds(lane):
            return False
        ep = lane.endpoint
        # Eligible (the same test as ``select``): a live local SUB lane that takes tasks;
        # not one waiting for a registration control or missing a callable (the Python
        # dispatch checks what it has installed).
        return (
            rec.endpoint is ep
            and type(ep) is LocalMailboxEndpoint
            and ep.poison_reason is None
            and not ep.stopping
            and not lane.stopping
            and not lane.deliveries
            and not lane.missing
        )

    def select(self, lanes: list[WorkerThread]) -> None:
        """Pick the lanes the next ``pump`` drives: those ``owns`` says, and the idle ones."""
        work = self._work
        work.clear()
        recs = self._lanes
        every = True  # every SUB lane joins the call (a task may then be queued)
        for lane in lanes:
            ep = lane.endpoint
            if not (
                type(ep) is LocalMailboxEndpoint
                and ep.poison_reason is None
                and not ep.stopping
                and not lane.stopping
                and not lane.deliveries
                and not lane.missing
            ):
                every = False
                continue
            rec = recs.get(id(lane))
            if rec is None or rec.lane is not lane or rec.endpoint is not ep:
                rec = recs[id(lane)] = _Lane(lane, ep)
            # ``rec.holds(lane)``, inline: only what the pump published is in flight.
            a, staged = lane.active, lane.staged
            if a is not None or staged is not None:
                d0 = rec.f0.dispatch
                f1 = rec.f1
                d1 = f1.dispatch if f1 is not None else None
                if not (
                    (a is None or a is d0 or a is d1)
                    and (staged is None or staged is d0 or staged is d1)
                ):
                    every = False
                    continue  # published by the Python path: its progress completes it
            work.append(rec)
        self._queue_ok = every

    def pump(self, queue: deque[TaskSlot], published: list[TaskSlot], spin: bool) -> list[_Lane]:
        """One C call over the lanes ``select`` picked and ``queue``; fills ``published``.

        Returns those lanes (their completions are in each frame's ``state[_DONE]``; what
        is in flight is their active dispatch again, and a task queued behind it their
        ``staged`` one). A frame that needs the Python path has ``state[_STOP]`` set: the
        caller runs the lane's ``progress``.
        """
        work = self._work
        states = self._states
        states.clear()
        # Queue frames join the call only when the queue holds more tasks than there are
        # free lanes (else the call could not queue one: a one-task run pays for no
        # queue frame), or when they hold a task.
        want = False
        if self._queue_ok:
            free = 0
            for rec in work:
                if rec.lane.active is None:
                    free += 1
            want = len(queue) > free
        for rec in work:
            lane = rec.lane
            active, staged = lane.active, lane.staged
            nxt = lane._next_dispatch_id
            for fr in rec.frames:
                st = fr.state
                d = fr.dispatch
                if d is not None and d is not active and d is not staged:
                    fr.dispatch = None  # the Python path completed it
                    st[_SLOT] = None
                st[_NEXT] = nxt
                st[_STOP] = 0
            f1 = rec.f1
            if f1 is None:
                states.append(rec.f0.state)
                continue
            f0 = rec.f0
            if want or (f0.dispatch is not None and f1.dispatch is not None):
                first = len(states)
                f0.state[_PEER] = first + 1
                f1.state[_PEER] = first
                states += rec.states
            else:
                # One frame, as a lane of its own: the busy one, or frame 0 of a free child
                # (a frame published without its peer is never queued behind anything).
                st = f1.state if f1.dispatch is not None else f0.state
                st[_PEER] = -1
                states.append(st)
        if not states:
            self._room = False
            self._count = 0
            return work
        spin_ns = 0
        #: Lanes whose task was still running as a spinning call started: its end within
        #: the call is one the spin caught (one that had ended before is not).
        running: list[_Frame] | None = None
        started = cpu = spent = 0.0
        if spin:
            self._calls += 1
            if self.hit_rate >= PUMP_MIN_HIT_RATE or self._calls % PUMP_PROBE_EVERY == 0:
                spin_ns = PUMP_SPIN_NS
                for rec in work:
                    buf = rec.endpoint.buf
                    for fr in rec.frames:
                        if (
                            fr.dispatch is not None
                            and _mb.load32(buf, fr.state[1] + OFF_STATE) in _RUNNING
                        ):
                            if running is None:
                                running = []
                            running.append(fr)
                started = time.monotonic()
                if self._by_cpu:
                    cpu = _thread_time()
        self._count = _mb.sub_pump(
            states, queue, _READY, published, spin_ns, PUMP_MAX_PUBLISH, self._queue_ok
        )
        if spin_ns:
            spent = time.monotonic() - started
            if self._by_cpu:
                cpu = _thread_time() - cpu  # the parent's CPU
        caught = 0  # completions a spinning call waited for
        busy = False  # tasks in flight at the start or the end of the call
        queued = False  # a task waits in a queue frame after the call
        room = False  # a frame could take a task after the call
        for rec in work:
            lane = rec.lane
            ep = rec.endpoint
            frames = rec.frames
            fresh: list[_Frame] | None = None
            for fr in frames:
                st = fr.state
                slot = st[_SLOT]
                done = st[_DONE]
                d = fr.dispatch
                # Make the lane, its endpoint and its frame say what the call left in flight.
                lane._next_dispatch_id = st[_NEXT]
                fr.done_issued_at = 0.0
                if slot is None and d is None and not done and not st[_STOP]:
                    continue  # idle before and after the call (most queue frames)
                did = st[_DID]
                n = len(done) if done else 0
                if n:
                    ep.tasks_completed += n
                if d is not None and (slot is not d.task_slot or did != d.dispatch_id):
                    # The task in flight before the call completed inside it (it is the
                    # first of the done list; it may have ended before the call).
                    n -= 1
                    if running is not None and fr in running:
                        caught += 1
                    fr.done_issued_at = d.issued_at
                    ep.fast_release(d)
                    if lane.active is d:
                        lane.active = None
                    elif lane.staged is d:
                        lane.staged = None
                    lane.inflight -= 1
                    fr.dispatch = d = None
                caught += n  # published by this call, ended within it
                if slot is not None:
                    if not st[_STOP]:
                        busy = True
                    if d is None:
                        d = fr.dispatch = WorkerDispatch(slot, 0, did)
                        d.issued_at = st[_AT] / 1e9
                        if fresh is None:
                            fresh = []
                        fresh.append(fr)
                if st[_STOP] == 2:
                    ep.poison(f"publication into a non-idle task frame {fr.index} (sub pump)")
            if rec.f1 is None:
                if fresh is not None:
                    d = frames[0].dispatch
                    assert d is not None
                    ep.fast_adopt(d, d.issued_at)
                    lane.active = d
                    lane.inflight += 1
                elif lane.active is None:
                    room = True
                continue
            if fresh is not None:
                if fresh[-1] is not fresh[0] and fresh[0].state[_DID] > fresh[1].state[_DID]:
                    fresh.reverse()
                for fr in fresh:  # in dispatch order: a queued task's deadline waits
                    d = fr.dispatch
                    assert d is not None
                    ep.fast_adopt(d, d.issued_at, fr.index)
                    lane.inflight += 1
            # The older task in flight is the lane's active dispatch, a newer one its
            # staged one (the child runs it next).
            d0, d1 = rec.f0.dispatch, rec.f1.dispatch
            if d0 is None:
                lane.active, lane.staged = d1, None
                room = room or d1 is None or self._queue_ok
            elif d1 is None:
                lane.active, lane.staged = d0, None
                room = room or self._queue_ok
            else:
                queued = True
                lane.active, lane.staged = (d1, d0) if d1.dispatch_id < d0.dispatch_id else (d0, d1)
        if spin_ns and (caught or busy or running):
            # A hit: the call took at most PUMP_HIT_S per completion it caught, of wall
            # time (short tasks) or of CPU (a spin that yielded its core to busy
            # children); a miss: it caught none, or it burned a core waiting for long
            # tasks that only happened to end while it spun. A call that had nothing to
            # wait for says nothing. A call long in wall time has the next one timed in
            # CPU as well (the first such call of a streak counts as a miss).
            if caught:
                bound = caught * PUMP_HIT_S
                long = spent > bound
                hit = not long or (self._by_cpu and cpu <= bound)
                self._by_cpu = long
            else:
                hit = False
            self.hit_rate += 0.125 * ((1.0 if hit else 0.0) - self.hit_rate)
        self._queued = queued
        self._room = room
        return work

    def drive(
        self,
        sched: PumpSink,
        q: deque[TaskSlot],
        lanes: list[WorkerThread],
        spin: bool,
        *,
        chain: bool,
    ) -> bool:
        """The Scheduler round's pump part: ``select`` among ``lanes``, then ``round``.

        With ``spin`` (a waiting driver) and ``chain`` (fifo: no other run's queue can
        get work meanwhile), again while what the call completed made
        the head of ``q`` ready (a dependency chain: the next task takes the C path too,
        not the Python dispatch of the round after) or the call stopped at
        ``PUMP_MAX_PUBLISH``, for at most ``PUMP_CHAIN_S``; never past a completion left
        to the Python path (a failure is seen before later tasks start), and not when
        every frame is busy while calls do not spin (the next could only poll them)."""
        self.select(lanes)
        did = self.round(sched, q, spin)
        if not (did and spin and chain and q):
            return did
        until = time.monotonic() + PUMP_CHAIN_S
        while q and q[0].state is _READY and not sched.completions:
            if (
                not self._room
                and self._count < PUMP_MAX_PUBLISH
                and self.hit_rate < PUMP_MIN_HIT_RATE
            ):
                # Every frame is busy and the next call would not wait for one to end:
                # it could only poll (500 µs tasks: a second call per round, ~20 µs of
                # parent CPU per task taken from the children).
                break
            self.select(lanes)
            if not self.round(sched, q, True) or time.monotonic() >= until:
                break
        return did

    def round(self, sched: PumpSink, q: deque[TaskSlot], spin: bool) -> bool:
        """The Scheduler round's part for the lanes ``select`` picked: run the C loop over
        ``q``, claim what it published and complete what it finished (in bulk, on
        ``sched``); then the child watch of the lanes it left busy, and the Python
        ``progress`` of a frame it left to Python. True when it did anything.

        ``spin``: the round belongs to a waiting driver, so the C loop may wait for the
        children, and what it completes feeds the spin gate. A round inside a submit
        sees a task as late as the orchestration's last submits took (a miss that says
        nothing about the task), and the submit phase of a run of 20,000 empty tasks alone
        would then turn spinning off for its wait."""
        published = self._published
        lanes = self.pump(q, published, spin)
        did = False
        if published:
            did = True
            sched.claim_published(published)
        now = 0.0 if spin else -1.0
        stuck: list[_Lane] | None = None
        for rec in lanes:
            stop = False
            batch: list[Any] | None = None  # the lane's completions, both frames'
            for fr in rec.frames:
                st = fr.state
                stop = stop or bool(st[_STOP])
                done: list[Any] = st[_DONE]
                if done:
                    did = True
                    items = done[:]
                    done.clear()
                    if not now:
                        now = time.monotonic()
                    if now > 0.0:
                        # Feed the spin gate (spingate.py): the task in flight before the
                        # call (dispatched at ``done_issued_at``) took until ``now``; the
                        # others were published and completed within the call, while the
                        # pump spun (a hit). Without these samples the gate never learns
                        # that pumped SUB tasks are long (500 µs tasks would keep it
                        # spinning).
                        gate = sched.spin_gate
                        k = len(items)
                        if fr.done_issued_at:
                            gate.observe(fr.done_issued_at, now)
                            k -= 1
                        gate.observe_caught(k, now)
                    if batch is None:
                        batch = items
                    else:
                        batch += items
            if batch is not None:
                sched.complete_pumped(rec.lane, batch)
            if rec.lane.inflight:
                if stop:
                    if stuck is None:
                        stuck = []
                    stuck.append(rec)
                else:
                    self.watch(rec.lane)
        if self._queued and not (q and q[0].state is _READY):
            did = self.rebalance(sched, lanes) or did
        if stuck is not None:
            if len(stuck) > 1:
                # Frames that did not end plainly (failures) reach the run in the order
                # their tasks were dispatched, so the first failure is the one it reports.
                stuck.sort(key=_issued_at)
            for rec in stuck:
                rec.lane.progress()
        return did

    def rebalance(self, sched: PumpSink, lanes: list[_Lane]) -> bool:
        """Nothing is left to publish, yet a lane is free while a task waits in another
        lane's queue frame (the tail of a run, or a long task ahead of it): take that task
        back if its child has not claimed it (compare-exchange TASK_READY -> IDLE) and
        queue it again, so the next round gives it to the free lane. True if it did."""
        free = 0
        for rec in lanes:
            lane = rec.lane
            if lane.active is None and not lane.inflight:
                free += 1
        if not free:
            return False
        did = False
        for rec in lanes:
            if self._withdraw(sched, rec, "another SUB lane is free"):
                did = True
                free -= 1
                if not free:
                    break
        return did

    def withdraw_digest(self, sched: PumpSink, digest: bytes) -> None:
        """Take back every queued task of the callable ``digest`` its child has not
        claimed (a reload begins: a task that has not started runs the new code)."""
        for rec in self._lanes.values():
            d = rec.lane.staged
            if d is not None and d.task_slot.digest == digest:
                self._withdraw(sched, rec, "its callable is being reloaded")

    def withdraw_run(self, sched: PumpSink, run: Run) -> None:
        """Take back every queued task of ``run`` its child has not claimed, without
        queueing it again (the run is being cancelled: a task that has not started
        fails SKIPPED with the run's other unstarted tasks)."""
        for rec in self._lanes.values():
            d = rec.lane.staged
            if d is not None and d.task_slot.run is run:
                self._withdraw(sched, rec, "its run is cancelled", requeue=False)

    def _withdraw(self, sched: PumpSink, rec: _Lane, why: str, *, requeue: bool = True) -> bool:
        """Take back the task the pump queued in ``rec``'s queue frame, if its child has
        not claimed it (compare-exchange TASK_READY -> IDLE), and queue it again (with
        ``requeue``; else it is left READY and unstarted for the caller)."""
        lane = rec.lane
        d = lane.staged
        if d is None or rec.f1 is None or rec.endpoint is not lane.endpoint:
            return False
        fr = rec.f0 if rec.f0.dispatch is d else rec.f1
        if fr.dispatch is not d or fr.state[_STOP]:
            return False
        ep = rec.endpoint
        if not _mb.cas32(ep.buf, fr.state[1] + OFF_STATE, _TASK_READY, _IDLE):
            return False  # claimed: the child runs it next
        ep.fast_release(d)
        lane.staged = None
        lane.inflight -= 1
        fr.dispatch = None
        fr.state[_SLOT] = None
        sched.requeue_withdrawn(
            d.task_slot,
            lane,
            f"taken back unstarted from {ep.who()}'s queue frame: {why}",
            requeue=requeue,
        )
        return True

    def watch(self, lane: WorkerThread) -> None:
        """The rest of ``lane.progress`` for a lane the pump polled: the child's watch.
        Its events (a poisoned endpoint's completions) go to the lane as usual."""
        ep = lane.endpoint
        assert isinstance(ep, LocalMailboxEndpoint)
        events = self._events
        ep.watch_progress(events)
        if events:
            lane.forward(events)

    def forget(self) -> None:
        """Drop every lane record (the lanes were replaced or stopped)."""
        self._lanes.clear()


def _issued_at(rec: _Lane) -> float:
    active = rec.lane.active
    return active.issued_at if active is not None else 0.0
