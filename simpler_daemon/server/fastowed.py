"""A fast-path call whose answer is owed until its run ends (server/fastpath.py).

A handler on the fast path returns a :class:`Deferred` for a SubmitRun that waits or a
WaitRun on a run still going; the connection then answers from the run's end (the
record's ``when_finished`` callbacks, after the run table's bookkeeping of that end:
a status with results shows what the finished run keeps), from the wait's timer,
from the call's deadline or not at all (a Cancel, the client gone), without a handler
woken for it. A lone run of quick tasks ends inside ``owe`` itself
(``RunRecord.settle``): answered there, with no future or timer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from simpler_daemon.protocol.fastwire import Reply, encode
from simpler_daemon.server.fastcontext import CODE_NUMBER, Deferred

if TYPE_CHECKING:
    from simpler_daemon.server.fastpath import _Call, _Connection

__all__ = ["OwedAnswer", "owe"]

log = logging.getLogger("simpler_daemon.daemon")

Code = grpc.StatusCode


def owe(conn: _Connection, call: _Call, name: str, deferred: Deferred) -> None:
    """Answer ``call`` (the RPC ``name``) on ``conn`` when ``deferred``'s run ends or its
    wait expires, from that turn."""
    owed = OwedAnswer(conn, call, name, deferred)
    rec = deferred.rec
    if rec.terminal:  # cannot happen (the handler checked, nothing ran since)
        owed.answer()
        return
    owed.remove = rec.when_finished(owed.answer)
    if not rec.settle() or owed.conn is not None:
        owed.arm()


class OwedAnswer:
    """A fast-path call whose answer is owed when its run ends or its wait expires.

    A future stands for the call meanwhile (``call.task``): a Cancel, the client going
    away or the daemon closing cancels it; its deadline (``_Connection.expire``)
    answers DEADLINE_EXCEEDED as a handler's would. Every reference it holds is
    dropped once it has answered or stopped: the run's callback list, the timer and
    the future all point back at it, and a cycle left behind would be garbage for the
    cyclic collector on every waiting call (it was ~30 objects a run)."""

    __slots__ = ("call", "conn", "deferred", "name", "remove", "timer", "waiting")

    def __init__(self, conn: _Connection, call: _Call, name: str, deferred: Deferred) -> None:
        self.conn: _Connection | None = conn
        self.call = call
        self.name = name
        self.deferred: Deferred | None = deferred
        self.waiting: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.remove: Callable[[], None] | None = None

    def arm(self) -> None:
        """The answer waits (the run's end is already listened to): a future stands for
        the call, and its wait's timer runs."""
        conn = self.conn
        assert conn is not None and self.deferred is not None
        loop = conn._loop
        waiting: asyncio.Future[None] = loop.create_future()
        self.waiting = waiting
        self.call.task = waiting
        timeout = self.deferred.timeout
        if timeout is not None:
            self.timer = loop.call_later(timeout, self.answer)
        waiting.add_done_callback(self.stopped)

    def _release(self) -> _Connection | None:
        """Drop every reference (the run's callback, the timer, the future); the
        connection, for the one answer still to write."""
        conn, self.conn = self.conn, None
        remove, self.remove = self.remove, None
        if remove is not None:
            remove()
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
        self.waiting = None
        self.call.task = None
        if conn is not None:
            conn._finish(self.call)
        return conn

    def answer(self) -> None:
        """The run ended, or the wait's time is up: write the reply."""
        waiting = self.waiting
        if waiting is not None:
            if waiting.done():
                return
            waiting.remove_done_callback(self.stopped)
            waiting.set_result(None)
        deferred, self.deferred = self.deferred, None
        conn = self._release()
        if conn is None or deferred is None:
            return
        call_id, name = self.call.id, self.name
        try:
            reply = conn._answer(call_id, name, deferred.finish())
        except Exception as exc:  # refused as the handler would have (include_results)
            try:
                code, details, field = deferred.refuse(exc)
            except Exception as bug:  # the mapping itself failed: still answer
                log.error("fast path: %s failed: %s", name, bug, exc_info=bug)
                code, details, field = (
                    Code.INTERNAL,
                    f"internal error in {name} ({type(bug).__name__}); see the daemon log",
                    "",
                )
            reply = Reply(call_id, CODE_NUMBER[code], details, field)
        conn._send(encode(reply))

    def stopped(self, _: asyncio.Future[None]) -> None:
        """Cancelled before the answer (a Cancel, the client gone, the call's deadline)."""
        self.deferred = None
        conn = self._release()
        if conn is not None and self.call.expired:
            conn._send(
                encode(
                    Reply(self.call.id, CODE_NUMBER[Code.DEADLINE_EXCEEDED], "Deadline Exceeded")
                )
            )
