"""What a drain owes the clients: the outputs of the runs it let finish.

A run that is active when a drain begins (``Drain``, SIGTERM, SIGINT) is *owed* to
its owner from then on, until, after the run ended, its owner has

* read each of the run's output buffers that still exists through ``ReadBuffer`` up
  to its last byte (an output buffer: one a task of the run, or the orchestration's
  arguments, names with tag OUTPUT, INOUT or OUTPUT_EXISTING; a buffer freed since
  is not owed any more), or, for a run without output buffers,
* taken its final status: a ``WaitRun`` (or ``SubmitRun`` with ``wait_seconds``)
  answered with it, or a ``WatchRun`` that delivered its terminal event.

A stopping daemon closes its workers (after which nothing can be read) only once no
run is owed, or when ``daemon.shutdown_grace`` since the stop began has passed::

    SubmitRun / RunOrchestration -> note(rec, outputs)     (every run; pruned as they end)
    drain begins                 -> begin(): the noted runs not terminal are owed
    ReadBuffer to the last byte  -> read(buffer, generation)
    WaitRun / WatchRun terminal  -> collected(run_id)
    FreeBuffer, Resume           -> changed() / end()
    daemon stopping              -> await wait(timeout): True once nothing is owed
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["OwedOutputs", "output_buffers"]

log = logging.getLogger("simpler_daemon.daemon")

#: The tags under which a task writes a buffer.
_OUTPUT_TAGS: Final = frozenset({pb.TAG_OUTPUT, pb.TAG_INOUT, pb.TAG_OUTPUT_EXISTING})
#: Seconds between two looks at what is owed when nothing was reported meanwhile.
_RECHECK: Final = 0.25
#: Noted runs kept before finished ones are pruned (then twice what is left).
_PRUNE_AT: Final = 1024

Key = tuple[int, int]  # (buffer_id, generation)


def output_buffers(args: Iterable[Any]) -> frozenset[int]:
    """The buffer ids of every tensor with an output tag in ``args`` (``Args`` messages)."""
    out: set[int] = set()
    for msg in args:
        for t in msg.tensors:
            if t.tag in _OUTPUT_TAGS:
                out.add(t.buffer_id)
    return frozenset(out)


class OwedOutputs:
    """The runs a drain owes their owners (see the module docstring); ``heap`` is the
    Worker's (a buffer freed or reused since is not owed)."""

    def __init__(self, heap: Any) -> None:
        self._heap = heap
        self._noted: dict[int, tuple[Any, frozenset[int]]] = {}
        self._prune_at = _PRUNE_AT
        #: run id -> (record, output buffers) of the runs owed since the drain began.
        self._owed: dict[int, tuple[Any, frozenset[Key]]] = {}
        self._read_ns: dict[Key, int] = {}
        self._collected: set[int] = set()
        self.tracking = False
        self._changed = asyncio.Event()

    # -- what happens ------------------------------------------------------------------

    def note(self, rec: Any, outputs: frozenset[int]) -> None:
        """A run was launched (``rec``: its RunRecord) with these output buffer ids."""
        noted = self._noted
        noted[rec.run_id] = (rec, outputs)
        if len(noted) >= self._prune_at:
            self._noted = {k: v for k, v in noted.items() if not v[0].terminal}
            self._prune_at = max(_PRUNE_AT, 2 * len(self._noted))
        if self.tracking and not rec.terminal:  # launched while draining (a queued one)
            self._owe(rec, outputs)

    def begin(self) -> None:
        """A drain begins: every noted run not yet terminal is owed to its owner."""
        self.tracking = True
        for rec, outputs in self._noted.values():
            if not rec.terminal:
                self._owe(rec, outputs)

    def _owe(self, rec: Any, outputs: frozenset[int]) -> None:
        # The generations now: the run pins its buffers, a FreeBuffer waits for its end.
        heap = self._heap
        keys = set()
        for buffer_id in outputs:
            try:
                keys.add((buffer_id, heap.get(buffer_id).generation))
            except KeyError:
                continue
        self._owed[rec.run_id] = (rec, frozenset(keys))

    def end(self) -> None:
        """The drain was undone (Resume): nothing is owed any more."""
        self.tracking = False
        self._owed.clear()
        self._read_ns.clear()
        self._collected.clear()

    def read(self, buffer_id: int, generation: int) -> None:
        """A ReadBuffer delivered the last byte of this buffer."""
        if self.tracking:
            self._read_ns[(buffer_id, generation)] = time.time_ns()
            self._changed.set()

    def collected(self, run_id: int) -> None:
        """The run's owner got its final status (WaitRun, SubmitRun's wait, WatchRun)."""
        if self.tracking and run_id in self._owed:
            self._collected.add(run_id)
            self._changed.set()

    def changed(self) -> None:
        """Something else may have settled a run (a FreeBuffer)."""
        if self.tracking:
            self._changed.set()

    # -- what is owed -------------------------------------------------------------------

    def owed(self) -> list[Any]:
        """The records of the runs still owed, oldest first."""
        heap = self._heap
        if heap.closed:
            return []
        out = []
        for run_id, (rec, outputs) in sorted(self._owed.items()):
            if not rec.terminal:
                out.append(rec)
            elif outputs:
                if any(self._unread(key, rec.finish_ns) for key in outputs):
                    out.append(rec)
            elif run_id not in self._collected:
                out.append(rec)
        return out

    def _unread(self, key: Key, finish_ns: int) -> bool:
        try:
            buf = self._heap.get(key[0])
        except KeyError:
            return False  # freed: nothing left to read
        if buf.generation != key[1]:
            return False  # freed, and the id went to a new buffer
        return self._read_ns.get(key, 0) < finish_ns

    async def wait(self, timeout: float) -> bool:
        """Wait until no run is owed; False when ``timeout`` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.owed():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, _RECHECK))
            except TimeoutError:
                pass
        return True

    async def settle(self, timeout: float, status: Callable[[str], Any]) -> bool:
        """The stopping daemon's wait: :meth:`wait` with its log lines and a ``status``
        line for systemd. False when something is left unread (``timeout`` passed, or
        it was 0 or less: daemon.shutdown_grace is used up)."""
        owed = self.owed()
        if not owed:
            return True
        if timeout <= 0:
            log.warning(
                "stopping: daemon.shutdown_grace is used up; the outputs of %d runs are left "
                "unread (%s)",
                len(owed),
                _runs(owed),
            )
            return False
        log.info(
            "stopping: waiting up to %.1fs for the owners of %d runs to read their outputs (%s)",
            timeout,
            len(owed),
            _runs(owed),
        )
        status(f"stopping: waiting up to {timeout:.0f}s for {len(owed)} runs' outputs to be read")
        if await self.wait(timeout):
            log.info("stopping: every output owed to a client was read")
            return True
        owed = self.owed()
        log.warning(
            "stopping: daemon.shutdown_grace ended with the outputs of %d runs unread (%s)",
            len(owed),
            _runs(owed),
        )
        return False


def _runs(records: list[Any]) -> str:
    shown = ", ".join(str(rec.run_id) for rec in records[:8])
    return f"runs {shown}" + (", ..." if len(records) > 8 else "")
