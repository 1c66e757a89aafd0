"""The blocking driver's auxiliary event loop: where the rare coroutines of the blocking
API run (``Driver.drive``: registration controls, close), and what they leave behind.

A task a blocking call leaves on this loop (a registration control queued behind a busy
child's task, ``engine/delivery.py``) stays there after ``drive`` returned: while any is
left (``aux_pending``), every round of whoever drives steps the loop once, without
blocking (``_step_aux``); ``bind`` first finishes them (``_finish_aux``: the bound loop
cannot step another loop) and ``close_aux`` cancels what is left. ``keeps_tasks(loop)``
tells a coroutine whether its loop goes on after it returned.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

log = logging.getLogger("simpler_daemon.driver")


class AuxLoop:
    """The auxiliary loop part of :class:`~simpler_daemon.scheduler.driver.Driver`."""

    #: The bound event loop (the Driver's); None while the blocking API drives.
    loop: asyncio.AbstractEventLoop | None

    def __init__(self) -> None:
        self._aux_loop: asyncio.AbstractEventLoop | None = None
        #: Tasks are left on ``_aux_loop`` (``drive`` returned before them): rounds step
        #: it and the background thread drives until they ended.
        self.aux_pending = False

    def close_aux(self) -> None:
        loop = self._aux_loop
        if loop is not None:
            # What is left (a control queued behind a child the close stopped) is
            # cancelled and run to its end: no task is destroyed pending.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(_wait_all(left))
            self.aux_pending = False
            # Join the loop's executor threads too: a thread left behind would make the
            # next fork in this process (a new Worker's init) refuse to run.
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
            self._aux_loop = None

    def keeps_tasks(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether a task on ``loop`` goes on once the coroutine that started it returned:
        on the bound loop, and (unbound) on the auxiliary loop ``drive`` runs, which the
        rounds step from then on."""
        if self.loop is not None:
            return loop is self.loop
        return loop is self._aux_loop

    def _step_aux(self) -> None:
        """Under ``lock``: run the auxiliary loop's ready callbacks (and due timers) once,
        without blocking, and note whether tasks are left on it."""
        loop = self._aux_loop
        if loop is None:
            self.aux_pending = False
            return
        if loop.is_running() or asyncio._get_running_loop() is not None:
            # Inside ``drive`` (it runs the loop already), or a blocking call from a
            # coroutine of another loop on this thread: the next round elsewhere steps it.
            return
        loop.call_soon(loop.stop)
        loop.run_forever()
        self.aux_pending = bool(asyncio.all_tasks(loop))

    def _finish_aux(self) -> None:
        """Under ``lock``: run the auxiliary loop until no task is left on it."""
        loop = self._aux_loop
        if loop is None or not self.aux_pending or loop.is_running():
            return
        left = asyncio.all_tasks(loop)
        if left:
            # ``bind`` runs on the loop being bound, where another loop cannot run: a
            # helper thread runs this one while this thread waits (never both at once).
            log.info("binding: finishing %d control(s) queued by the blocking API", len(left))
            helper = threading.Thread(
                target=loop.run_until_complete, args=(_wait_all(left),), name="simpler-aux"
            )
            helper.start()
            helper.join()
        self.aux_pending = bool(asyncio.all_tasks(loop))


async def _wait_all(tasks: set[asyncio.Task[Any]]) -> None:
    await asyncio.wait(tasks)
