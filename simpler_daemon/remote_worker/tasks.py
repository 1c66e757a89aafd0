"""One TASK in the session runner: its frame in, the inner run, its COMPLETION out.

The hot path of a remote task takes no loop turn in the runner beyond the read that
brought its frame, and no asyncio Task (REMOTE.md section 5: one request at a time, in
order)::

    read callback: TASK s ─> prepare() ─> submit(): inner.submit_async ─> inner run
                                                                               │
    transport.write(COMPLETION s) <── completion() <── the run's done callback <┘

``submit`` is a coroutine only because ``Worker.submit_async`` is one; it never waits,
so the session steps it once, inline, from the read callback (:func:`resume` finishes
one that would wait). No coroutine waits for the run: the reply is built and written
by the run's done callback, on the loop turn that ends the run, so nothing is scheduled
between the inner run's end and the bytes on the wire. A TASK with ``deadline_ms`` adds
a loop timer; only when it fires does a coroutine stop the run
(:meth:`TaskRunner.stop_late`).

This module turns the payloads into inner-worker calls and outcomes into
:class:`~simpler_daemon.remote.wire.Completion` structs; ordering the command lane
and writing the bytes is :mod:`simpler_daemon.remote_worker.session`'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from simpler_daemon.args import CallConfig, TaskArgs
from simpler_daemon.callables import hashid_of_digest
from simpler_daemon.engine.handle import RunHandle
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import TaskError
from simpler_daemon.remote.wire import (
    E_BAD_ARGS,
    E_DEADLINE,
    E_OK,
    E_TASK_FAILED,
    E_UNKNOWN_CALLABLE,
    Completion,
    Task,
    WireConfig,
    clip_text,
)
from simpler_daemon.remote_worker.controls import BadTaskArgs, SessionControls, format_exception
from simpler_daemon.taskvalues import checked_received

log = logging.getLogger("simpler_daemon.remote.session")

#: A run past its deadline gets this long to stop (its children are SIGKILLed) before the
#: runner answers anyway: well inside the parent's margin, so the session survives.
DEADLINE_STOP_S: Final = 0.5
#: Distinct CallConfigs kept (a parent reuses one config for all tasks of a run).
CONFIG_CACHE: Final = 256

#: The success reply's payload, shared (a frozen struct).
COMPLETED: Final = Completion(error_code=E_OK, error_text="")

T = TypeVar("T")


async def resume(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """The rest of ``coro``, whose first step ran inline (``coro.send(None)``) and
    suspended, yielding ``yielded``: what an asyncio Task would have done with it.

    ``yielded`` is the future ``coro`` waits for (None for a bare yield, as
    ``asyncio.sleep(0)``). Each later step runs once what it yielded is done, so the
    future's result or exception reaches ``coro`` where it awaited it. Cancelled,
    ``coro`` gets the cancellation where it waits."""
    while True:
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                yielded._asyncio_future_blocking = False  # as Task.__step: taken over
                await asyncio.wait((yielded,))
        except asyncio.CancelledError as exc:
            if yielded is not None:
                yielded.cancel()
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            continue
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


@dataclass(slots=True)
class Started:
    """A TASK whose inner run was submitted; it ends with one COMPLETION."""

    sequence: int
    digest: bytes
    handle: RunHandle
    deadline_ms: int
    #: The loop timer of ``deadline_ms`` (None without a deadline or once it is cancelled).
    timer: asyncio.TimerHandle | None = None
    #: True once the deadline fired: the stopping coroutine answers, not the done callback.
    late: bool = False


class TaskRunner:
    """Prepares, submits and judges the TASKs of one session (errors name the worker)."""

    def __init__(self, inner: Worker, controls: SessionControls, worker_id: int, host: str):
        self.inner = inner
        self.controls = controls
        self.worker_id = worker_id
        self.host = host
        self.where = f"remote worker {worker_id} (host {host})"
        self._configs: dict[WireConfig, CallConfig] = {}

    def _ident(self, digest: bytes, seq: int) -> str:
        return f"hashid={hashid_of_digest(digest)}, sequence={seq}"

    def config(self, c: WireConfig) -> CallConfig:
        """The CallConfig of a wire config (cached: building one packs its frame bytes).

        Raises ``ValueError`` / ``TypeError`` for a field out of CallConfig's range."""
        hit = self._configs.get(c)
        if hit is None:
            hit = CallConfig(
                c.deadline_ms, c.threads, c.enable_profile, c.enable_dump_args, c.output_prefix
            )
            if len(self._configs) >= CONFIG_CACHE:
                self._configs.clear()
            self._configs[c] = hit
        return hit

    def prepare(
        self, seq: int, task: Task
    ) -> tuple[Callable[..., Any], TaskArgs, CallConfig] | Completion:
        """The orchestration, its args and config, or the Completion refusing the TASK."""
        controls = self.controls
        controls.counters.tasks += 1
        fn = controls.resolve(task.digest)
        if fn is None:
            controls.counters.tasks_failed += 1
            return Completion(
                error_code=E_UNKNOWN_CALLABLE,
                error_text=clip_text(
                    f"callable hash {hashid_of_digest(task.digest)} not registered on worker "
                    f"{self.worker_id} (host {self.host})"
                ),
            )
        try:
            config = self.config(task.config)
            args = controls.task_args(task.tensors, task.scalars)
            if task.values or task.kwargs:
                # Checked now: malformed bytes refuse the TASK here, naming it.
                args._values = checked_received(task.values, task.kwargs, "task")
        except (BadTaskArgs, ValueError, TypeError) as exc:
            controls.counters.tasks_failed += 1
            return Completion(
                error_code=E_BAD_ARGS,
                error_text=clip_text(
                    f"{self.where} cannot run {self._ident(task.digest, seq)}: {exc}"
                ),
            )
        return fn, args, config

    async def submit(
        self, seq: int, task: Task, fn: Callable[..., Any], args: TaskArgs, config: CallConfig
    ) -> Started | Completion:
        """Submit the inner run; a Completion when the submission itself failed."""
        try:
            handle = await self.inner.submit_async(fn, args, config)
        except Exception as exc:
            self.controls.task_done()
            return self.failed(seq, task.digest, exc)
        return Started(seq, task.digest, handle, config.deadline_ms)

    def completion(self, started: Started) -> Completion:
        """The reply of a TASK whose run is terminal (frees its inline buffers)."""
        self.controls.task_done()
        error = started.handle.exception()
        if error is None:
            return COMPLETED
        return self.failed(started.sequence, started.digest, error)

    def failed(self, seq: int, digest: bytes, exc: BaseException) -> Completion:
        """The Completion of a run (or a submission) that raised ``exc``."""
        self.controls.counters.tasks_failed += 1
        ident = self._ident(digest, seq)
        if isinstance(exc, TaskError):
            first = str(exc).split("\n", 1)[0]
            return Completion(
                error_code=E_TASK_FAILED,
                error_text=clip_text(f"{self.where} run failed: {ident}: {first}"),
                traceback=clip_text(exc.remote_text or format_exception(exc)),
            )
        return Completion(
            error_code=E_TASK_FAILED,
            error_text=clip_text(f"{self.where} run failed: {ident}: {type(exc).__name__}: {exc}"),
            traceback=clip_text(format_exception(exc)),
        )

    async def stop_late(self, started: Started) -> Completion:
        """Stop a run past its deadline as the local engine does: its running tasks'
        children are killed (and replaced by the inner worker), the rest never starts.
        Waits at most ``DEADLINE_STOP_S``, so the parent has the reply well inside its
        own margin (``TASK_DEADLINE_GRACE_S``) and keeps the session."""
        handle, deadline_ms = started.handle, started.deadline_ms
        self.inner.cancel(handle, terminate=True, reason=f"deadline exceeded ({deadline_ms} ms)")
        with contextlib.suppress(Exception):
            await handle.wait_async(DEADLINE_STOP_S)
        if handle.done():
            state = "the run was stopped (its running tasks killed, their workers replaced)"
        else:
            log.warning(
                "worker %d: a run past its deadline of %d ms is still stopping after %.1f s",
                self.worker_id,
                deadline_ms,
                DEADLINE_STOP_S,
            )
            state = "the run was cancelled and is still stopping"
        self.controls.task_done()
        self.controls.counters.tasks_failed += 1
        return Completion(
            error_code=E_DEADLINE,
            error_text=clip_text(
                f"{self.where} run failed: {self._ident(started.digest, started.sequence)}: "
                f"deadline exceeded ({deadline_ms} ms); {state}"
            ),
        )
