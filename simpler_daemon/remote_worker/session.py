"""``simpler-remote-l3-session``: one remote L3 session, exec'd by ``simpler-remote-worker``.

Bring-up, in this order (REMOTE.md section 3)::

    read spec -> deadline, PR_SET_PDEATHSIG, sys.path
              -> install allow-listed callables (import + hashid check)
              -> Worker(level=3) + register + init()        (every fork happens here)
              -> bind command + health listeners (port 0, TLS when configured)
              -> health thread (accepts the health lane, then beats)
              -> ONE ready line on --ready-fd, fd closed
              -> uvloop: accept + attach both lanes before the deadline
              -> HELLO(ready) on the command lane -> serve

    parent                       runner (this process)                  inner children
      |-- TASK/CONTROL/SHUTDOWN -->| CommandProtocol -> frames, in order
      |                            |   TASK -> inner.submit_async(fn, args) --> SUB / chip
      |<-- COMPLETION -------------|     written by the run's done callback (tasks.py)
      |<-- CONTROL_REPLY ----------|   CONTROL -> SessionControls.handle()
      |<-- HEALTH every 0.2 s -----| HealthLane thread (never runs user code)

The session ends (inner worker closed, nothing left behind) on command EOF,
SHUTDOWN, SIGTERM (exit 0), or a protocol error, a failed health send, a
missed attach deadline, the parent's death (exit 1).

The lanes themselves (listeners, TLS, attach bytes, the health thread, the
command protocol) live in :mod:`simpler_daemon.remote_worker.lanes`; this module
brings the session up, orders its requests and tears it down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import hmac
import logging
import os
import select
import signal
import socket
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable
from functools import partial
from typing import Any

import msgspec

from simpler_daemon.callables import restrict_imports
from simpler_daemon.children.process import set_process_title, set_title_prefix
from simpler_daemon.engine.worker import Worker
from simpler_daemon.errors import ProtocolError
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.remote.manifest import HandshakeReply, RunnerSpec, format_host_port
from simpler_daemon.remote.wire import (
    CONTROL_BODIES,
    E_CONTROL_FAILED,
    E_OK,
    PROTOCOL_VERSION,
    Completion,
    Control,
    ControlReply,
    Frame,
    FrameType,
    Hello,
    Task,
    clip_text,
    encode_frame,
)
from simpler_daemon.remote_worker.controls import (
    IMMEDIATE_CONTROLS,
    ControlFailure,
    InstallError,
    SessionControls,
    check_target,
)
from simpler_daemon.remote_worker.lanes import (
    ATTACH_BYTES,
    CANDIDATE_S,
    HEALTH_CANDIDATE_S,
    HEALTH_INTERVAL_S,
    MAX_CANDIDATES,
    CommandProtocol,
    HealthLane,
    listen,
    server_tls,
    tune_socket,
)
from simpler_daemon.remote_worker.launch import same_host
from simpler_daemon.remote_worker.tasks import Started, TaskRunner, resume

log = logging.getLogger("simpler_daemon.remote.session")

#: After a reply, spin this long for the parent's next request before the loop parks
#: (a parent on another host only: see ``parent_on_this_host``).
LINGER_S = 0.0002


class StartFailure(Exception):
    """Bring-up failed; the text goes into the ready line (``ok: false``)."""


# -- the runner ------------------------------------------------------------------------------------


class SessionRunner:
    """Bring-up, attach, serve, close: one per process (see the module docstring)."""

    def __init__(self, spec: RunnerSpec, deadline: float) -> None:
        self.spec = spec
        self.manifest = spec.manifest
        self.session_id = spec.manifest.session_id
        self.worker_id = spec.manifest.worker_id
        # "simpler-remote-l3-session: session 3" in ps; its children add their own name.
        title = f"simpler-remote-l3-session: session {self.session_id}"
        set_title_prefix(title)
        set_process_title(title)
        self.attach_bytes = self.session_id.to_bytes(8, "little") + bytes.fromhex(
            spec.manifest.attach_key
        )
        self.deadline = deadline  # time.monotonic() based
        self.host = socket.gethostname()
        self.parent_pid = os.getppid()
        self.tls: ssl.SSLContext | None = None
        self.inner: Worker | None = None
        self.controls: SessionControls | None = None
        self.command_listener: socket.socket | None = None
        self.health_listener: socket.socket | None = None
        self.health: HealthLane | None = None
        self.candidates: dict[CommandProtocol, None] = {}
        self.stop_seen = threading.Event()
        #: Seconds to spin for the next request after a reply (see ``_linger``); 0 once
        #: the parent turns out to share this host's CPUs.
        self.linger_s = LINGER_S
        self._linger_poll: select.poll | None = None
        self.command: CommandProtocol | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[tuple[int, str]] | None = None
        self._early_stop: tuple[int, str] | None = None
        self._health_ready: asyncio.Future[None] | None = None
        self._command_ready: asyncio.Future[None] | None = None
        self._queue: deque[Frame] = deque()
        self._busy = False
        #: The coroutine of the request in flight: a control, the stop of a late run, or
        #: a TASK's submission that had to wait (never so far: it is made inline). None
        #: while a TASK's run goes on by itself.
        self._current: asyncio.Task[None] | None = None
        self.tasks: TaskRunner | None = None
        #: The TASK whose inner run is in flight (its done callback replies).
        self._started: Started | None = None
        self._loop_thread = 0
        self._next_seq = 1

    # -- bring-up (synchronous, single-threaded until the health thread starts) -------------------

    def bring_up(self) -> tuple[str, str]:
        """Install callables, start the inner worker, bind listeners, start the health thread.

        Returns the command and health addresses. Raises :class:`StartFailure`
        after releasing whatever was started.
        """
        m = self.manifest
        # The dispatcher registry first: nothing is started for a session whose
        # callables are not allowed, do not import, or carry a wrong hashid.
        allowed = tuple(self.spec.allowed_modules)
        restrict_imports(allowed)  # the inner Worker's children resolve under it too
        for i, c in enumerate(m.callables):
            try:
                check_target(c.target, c.kind, c.hashid, allowed)
            except InstallError as exc:
                raise StartFailure(
                    f"cannot start session: callables[{i}] ({c.kind} {c.target!r}): {exc}"
                ) from exc
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise StartFailure("cannot start session: the start-up deadline already passed")
        # A parent on this host shares its CPUs with the inner children: a child spinning
        # for its next task after the run's last one holds the CPU the parent needs to
        # read the reply (on 2 cores W7 measured 0.73-0.76 x the round trip without the
        # spin; a run of 100 empty SUB tasks took about the same 23 us per task either
        # way). See docs/remote.md, "Latency of one remote task".
        spin: dict[str, Any] = {"child_spin_ns": 0} if self.spec.parent_on_this_host else {}
        try:
            inner = Worker(
                level=3,
                num_sub_workers=m.num_sub_workers,
                num_chips=m.num_chips,
                heap_bytes=m.heap_bytes,
                chip_pipeline_depth=m.chip_pipeline_depth,
                startup_timeout=remaining,
                **spin,
            )
        except ValueError as exc:
            raise StartFailure(
                f"cannot start session: manifest (num_sub_workers={m.num_sub_workers}, "
                f"num_chips={m.num_chips}, heap_bytes={m.heap_bytes}, "
                f"chip_pipeline_depth={m.chip_pipeline_depth}) is refused: {exc}"
            ) from exc
        self.inner = inner
        self.controls = SessionControls(
            inner,
            worker_id=self.worker_id,
            host=self.host,
            allowed_modules=allowed,
            session_generation=m.session_generation,
        )
        self.tasks = TaskRunner(inner, self.controls, self.worker_id, self.host)
        for i, c in enumerate(m.callables):
            try:
                self.controls.install(c.hashid, c.kind, c.target)
            except Exception as exc:
                raise StartFailure(
                    f"cannot start session: callables[{i}] ({c.kind} {c.target!r}): {exc}"
                ) from exc
        try:
            inner.init()
        except Exception as exc:
            raise StartFailure(f"cannot start session: inner worker: {exc}") from exc
        try:
            self.tls = server_tls(self.spec)
            self.command_listener = listen(self.spec.listen_host)
            self.health_listener = listen(self.spec.listen_host)
        except (OSError, ssl.SSLError) as exc:
            raise StartFailure(
                f"cannot start session: cannot listen on {self.spec.listen_host}: {exc}"
            ) from exc
        self.health = HealthLane(self, self.health_listener)
        self.health.start()
        host = self.spec.listen_host
        return (
            format_host_port(host, self.command_listener.getsockname()[1]),
            format_host_port(host, self.health_listener.getsockname()[1]),
        )

    def close_budget(self) -> float:
        """Seconds the inner worker gets to drain and stop at the end of the session."""
        return min(10.0, max(2.0, self.manifest.session_timeout_s))

    def parent_gone(self) -> bool:
        return os.getppid() != self.parent_pid

    def attach_ok(self, data: bytes) -> bool:
        return len(data) == ATTACH_BYTES and hmac.compare_digest(data, self.attach_bytes)

    # -- loop plumbing (callable from any thread) ---------------------------------------------------

    def call_threadsafe(self, fn: Any, *args: Any) -> None:
        loop = self.loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed: we are exiting
            loop.call_soon_threadsafe(fn, *args)

    def stop_threadsafe(self, code: int, reason: str) -> None:
        if self.loop is None:
            self._early_stop = self._early_stop or (code, reason)
            return
        self.call_threadsafe(self.stop, code, reason)

    def stop(self, code: int, reason: str) -> None:
        """Ask the session to end (first reason wins); safe to call repeatedly."""
        self.stop_seen.set()
        fut = self._stopped
        if fut is None:
            self._early_stop = self._early_stop or (code, reason)
        elif not fut.done():
            fut.set_result((code, reason))

    def health_attached(self) -> None:
        if self._health_ready is not None and not self._health_ready.done():
            self._health_ready.set_result(None)

    def command_attached(self, proto: CommandProtocol, data: bytes) -> bool:
        if self.command is not None or not self.attach_ok(data):
            return False
        self.command = proto
        if self._command_ready is not None and not self._command_ready.done():
            self._command_ready.set_result(None)
        return True

    # -- serving --------------------------------------------------------------------------------------

    async def serve(self) -> int:
        """Attach, HELLO, serve until a stop reason; returns the exit code."""
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._loop_thread = threading.get_ident()
        self._stopped = loop.create_future()
        self._health_ready = loop.create_future()
        self._command_ready = loop.create_future()
        if self._early_stop is not None:
            self._stopped.set_result(self._early_stop)
        if self.health is not None and self.health.sock is not None:
            self._health_ready.set_result(None)  # attached before the loop existed
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, 0, f"{signal.Signals(sig).name} received")
        assert self.inner is not None
        try:
            await self.inner.start_async()
            acceptor = loop.create_task(self._accept_commands())
            try:
                code_reason = await self._attach()
            finally:
                acceptor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acceptor
                for proto in list(self.candidates):
                    if proto is not self.command and proto.transport is not None:
                        proto.transport.abort()
            if code_reason is None:
                # Attached: nobody may connect any more, and a late candidate must be
                # refused by the kernel, not left waiting in a listen backlog.
                self._close_listeners()
                if parent_on_this_host(self.command):
                    self.linger_s = 0.0
                self._send_hello()
                assert self.health is not None
                self.health.beat_event.set()
                log.info("worker %d: session %d attached", self.worker_id, self.session_id)
                code, reason = await self._stopped
            else:
                code, reason = code_reason
            log.info("worker %d: session ends (exit %d): %s", self.worker_id, code, reason)
            return code
        finally:
            await self._shutdown()

    async def _attach(self) -> tuple[int, str] | None:
        """None once both lanes are attached; else the (code, reason) to exit with."""
        assert self._stopped is not None
        assert self._command_ready is not None and self._health_ready is not None
        waiting = {self._command_ready, self._health_ready}
        while True:
            remaining = self.deadline - time.monotonic()
            if self._stopped.done():
                return self._stopped.result()
            if all(f.done() for f in waiting):
                return None
            if remaining <= 0:
                missing = [
                    name
                    for name, f in (
                        ("command", self._command_ready),
                        ("health", self._health_ready),
                    )
                    if not f.done()
                ]
                return (1, f"attach deadline missed: no {' and '.join(missing)} lane attached")
            futs: list[asyncio.Future[Any]] = [self._stopped, *waiting]
            await asyncio.wait(
                [f for f in futs if not f.done()],
                timeout=remaining,
                return_when=asyncio.FIRST_COMPLETED,
            )

    async def _accept_commands(self) -> None:
        loop = asyncio.get_running_loop()
        listener = self.command_listener
        assert listener is not None
        listener.setblocking(False)
        # Candidates still in their TLS handshake, oldest first (bounded like the rest).
        pending: dict[asyncio.Task[Any], None] = {}
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(listener)
                except OSError as exc:  # EMFILE and the like: candidates time out, retry
                    log.warning("command lane: cannot accept a connection: %s", exc)
                    await asyncio.sleep(0.05)
                    continue
                if len(pending) >= MAX_CANDIDATES:
                    log.warning("command lane: dropped the oldest of %d candidates", len(pending))
                    oldest = next(iter(pending))
                    del pending[oldest]  # counted out now: a burst drops one per newcomer
                    oldest.cancel()
                try:
                    tune_socket(conn, self.manifest.session_timeout_s)
                except OSError as exc:
                    log.warning("command lane: dropped a candidate connection: %s", exc)
                    conn.close()
                    continue
                t = loop.create_task(self._start_candidate(conn))
                pending[t] = None
                t.add_done_callback(lambda done: pending.pop(done, None))
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _start_candidate(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                lambda: CommandProtocol(self),
                conn,
                ssl=self.tls,
                ssl_handshake_timeout=(
                    max(0.1, min(CANDIDATE_S, self.deadline - time.monotonic()))
                    if self.tls is not None
                    else None
                ),
            )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            log.warning("command lane: dropped a candidate connection: %s", exc)
            conn.close()
        except asyncio.CancelledError:
            conn.close()
            raise

    def _send_hello(self) -> None:
        hello = Hello(
            session_id=self.session_id,
            worker_id=self.worker_id,
            protocol_version=PROTOCOL_VERSION,
            features=0,
            ready=True,
            host=self.host[:1024],
            pid=os.getpid(),
        )
        self._write(encode_frame(FrameType.HELLO, self.session_id, self.worker_id, 0, hello))

    def _write(self, data: bytes) -> None:
        proto = self.command
        if proto is not None and proto.transport is not None and not proto.transport.is_closing():
            proto.transport.write(data)

    def frames_received(self, frames: list[Frame]) -> None:
        for frame in frames:
            if frame.sequence != self._next_seq:
                self.stop(
                    1,
                    f"protocol error on the command lane: {frame.type.name} frame has sequence "
                    f"{frame.sequence}, expected {self._next_seq}",
                )
                return
            self._next_seq += 1
            self._queue.append(frame)
        self._pump()

    def _pump(self) -> None:
        """Start the next request unless one is in flight (strictly one at a time)."""
        while not self._busy and self._queue:
            if self._stopped is None or self._stopped.done():
                return
            frame = self._queue.popleft()
            if frame.type is FrameType.SHUTDOWN:
                self.stop(0, "SHUTDOWN received")
                return
            payload = frame.payload
            if (
                frame.type is FrameType.CONTROL
                and isinstance(payload, Control)
                and (payload.name in IMMEDIATE_CONTROLS or payload.name not in CONTROL_BODIES)
            ):
                # Buffer controls never wait: answer from the read callback, no task hop.
                try:
                    self._write(self._control_now(frame.sequence, payload))
                except Exception as exc:  # a runner bug: end the session, never hang it
                    log.exception("worker %d: request %d failed", self.worker_id, frame.sequence)
                    self.stop(1, f"internal error handling sequence {frame.sequence}: {exc!r}")
                    return
                continue
            self._busy = True
            assert self.loop is not None
            if frame.type is FrameType.TASK:
                assert isinstance(payload, Task)
                self._start_task(frame.sequence, payload)
            else:
                self._current = self.loop.create_task(self._handle_control(frame))

    def _reply(self, data: bytes) -> None:
        """Write a request's reply and go on with the next one (the request is over)."""
        self._write(data)
        self._busy = False
        self._current = None
        self._pump()
        if not self._busy and not self._queue:
            self._linger()

    def _internal_error(self, seq: int, exc: BaseException) -> None:
        """A runner bug: end the session rather than hang the parent."""
        log.error("worker %d: request %d failed", self.worker_id, seq, exc_info=exc)
        self.stop(1, f"internal error handling sequence {seq}: {exc!r}")

    def _complete(self, seq: int, reply: Completion) -> None:
        """Write the COMPLETION of TASK ``seq`` and go on with the next request."""
        self._reply(encode_frame(FrameType.COMPLETION, self.session_id, self.worker_id, seq, reply))

    def _start_task(self, seq: int, task: Task) -> None:
        """Prepare and submit a TASK's inner run from the read callback that brought it
        (no loop turn, no asyncio Task); its done callback replies (``_task_ended``)."""
        tasks, loop = self.tasks, self.loop
        assert tasks is not None and loop is not None
        try:
            prepared = tasks.prepare(seq, task)
            if isinstance(prepared, Completion):
                self._complete(seq, prepared)
                return
            started_at = loop.time()
            submitting = tasks.submit(seq, task, *prepared)
            try:
                # ``Worker.submit_async`` never awaits: its first step finishes it.
                yielded = submitting.send(None)
            except StopIteration as stop:
                self._submitted(seq, stop.value, started_at)
                return
            # A submission that does wait goes on as a coroutine (``_current``).
            self._current = loop.create_task(
                self._submit_later(seq, resume(submitting, yielded), started_at)
            )
        except Exception as exc:
            self._internal_error(seq, exc)

    async def _submit_later(
        self, seq: int, submitting: Awaitable[Started | Completion], started_at: float
    ) -> None:
        try:
            started = await submitting
            self._current = None
            self._submitted(seq, started, started_at)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._internal_error(seq, exc)

    def _submitted(self, seq: int, started: Started | Completion, started_at: float) -> None:
        """The inner run is submitted (or its submission failed: reply now)."""
        if isinstance(started, Completion):
            self._complete(seq, started)
            return
        self._started = started
        if started.deadline_ms:
            assert self.loop is not None
            started.timer = self.loop.call_at(
                started_at + started.deadline_ms / 1000.0, self._task_late, started
            )
        # The run's own callback list, not RunHandle.add_done_callback: the inner run is
        # driven by this loop's thread, the one registering, so its end cannot race
        # this (the handle's lock and wrappers are for callers on other threads).
        started.handle.run.add_done_callback(partial(self._run_ended, started))

    def _run_ended(self, started: Started, _run: object) -> None:
        """The run's done callback: never raises into the inner Scheduler."""
        try:
            self._task_ended(started)
        except Exception as exc:
            self._internal_error(started.sequence, exc)

    def _task_ended(self, started: Started) -> None:
        """The inner run of ``started`` is terminal: write its COMPLETION now (no task hop)."""
        if threading.get_ident() != self._loop_thread:
            self.call_threadsafe(self._task_ended, started)
            return
        if started.late or self._started is not started:
            return  # the deadline's coroutine answers (or the session is ending)
        self._started = None
        if started.timer is not None:
            started.timer.cancel()
        assert self.tasks is not None
        try:
            reply = self.tasks.completion(started)
        except Exception as exc:
            self._internal_error(started.sequence, exc)
            return
        self._complete(started.sequence, reply)

    def _task_late(self, started: Started) -> None:
        """``deadline_ms`` passed before the run ended: stop it, then answer E_DEADLINE."""
        if self._started is not started or started.handle.done():
            return  # its done callback is on its way
        started.late = True
        started.timer = None
        assert self.loop is not None
        self._current = self.loop.create_task(self._answer_late(started))

    async def _answer_late(self, started: Started) -> None:
        assert self.tasks is not None
        try:
            reply = await self.tasks.stop_late(started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._internal_error(started.sequence, exc)
            return
        self._started = None
        self._complete(started.sequence, reply)

    async def _handle_control(self, frame: Frame) -> None:
        try:
            assert isinstance(frame.payload, Control)
            data = await self._control(frame.sequence, frame.payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._internal_error(frame.sequence, exc)
            return
        self._reply(data)

    def _linger(self) -> None:
        """Spin briefly on the command socket after a reply: a parent that sends its next
        request at once then finds this loop awake instead of paying the wake-up of a
        parked process (the same spin-then-park as the mailbox children).

        Not for a parent on this host: there the spin holds the CPU the parent needs to
        read the reply and send that next request (with the SUB child's own spin, both
        cores of a 2-core host), so it delays what it waits for; W7 on loopback measured
        0.72 x the round trip without it (docs/remote.md, "Latency of one remote task")."""
        if self.linger_s <= 0:
            return  # a parent on this host: nothing to look up after each reply
        proto = self.command
        transport = proto.transport if proto is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return
        poller = self._linger_poll
        if poller is None:
            poller = self._linger_poll = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
        until = time.perf_counter() + self.linger_s
        while time.perf_counter() < until:
            if poller.poll(0):  # releases the GIL: the health thread is never held up
                return

    def _control_now(self, seq: int, ctl: Control) -> bytes:
        assert self.controls is not None
        try:
            result = self.controls.handle_now(ctl.name, ctl.version, ctl.body)
            code, text = E_OK, ""
        except ControlFailure as f:
            result, code, text = b"", f.code, f.text
        return self._control_reply(seq, ctl, code, text, result)

    async def _control(self, seq: int, ctl: Control) -> bytes:
        assert self.controls is not None
        try:
            result = await self.controls.handle(ctl.name, ctl.version, ctl.body)
            code, text = E_OK, ""
        except ControlFailure as f:
            result, code, text = b"", f.code, f.text
        return self._control_reply(seq, ctl, code, text, result)

    def _control_reply(self, seq: int, ctl: Control, code: int, text: str, result: bytes) -> bytes:
        reply = ControlReply(
            name=ctl.name,
            version=ctl.version,
            error_code=code,
            error_text=clip_text(text),
            result=result,
        )
        try:
            return encode_frame(
                FrameType.CONTROL_REPLY, self.session_id, self.worker_id, seq, reply
            )
        except ProtocolError as exc:
            reply = ControlReply(
                name=ctl.name,
                version=ctl.version,
                error_code=E_CONTROL_FAILED,
                error_text=clip_text(f"cannot reply to {ctl.name!r}: {exc}"),
            )
            return encode_frame(
                FrameType.CONTROL_REPLY, self.session_id, self.worker_id, seq, reply
            )

    async def _shutdown(self) -> None:
        started, self._started = self._started, None  # its done callback answers no more
        if started is not None and started.timer is not None:
            started.timer.cancel()
        current = self._current
        if current is not None:
            current.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await current
        if self.command is not None and self.command.transport is not None:
            self.command.transport.abort()
        if self.inner is not None:
            await self.inner.close_async(self.close_budget())

    # -- teardown (synchronous, after the loop) -------------------------------------------------

    def close(self) -> None:
        """Stop the health thread, close listeners and the inner worker (idempotent)."""
        if self.health is not None:
            self.health.stop_event.set()
            self.health.beat_event.set()
            if self.health.is_alive():
                self.health.join(timeout=HEALTH_INTERVAL_S * 5 + HEALTH_CANDIDATE_S)
        self._close_listeners()
        if self.inner is not None:
            self.inner.close()

    def _close_listeners(self) -> None:
        for sock in (self.command_listener, self.health_listener):
            if sock is not None:
                sock.close()
        self.command_listener = self.health_listener = None


def parent_on_this_host(proto: CommandProtocol | None) -> bool:
    """True when the command connection comes from this host: a loopback peer, or a peer
    with the connection's own local address (both ends share this host's CPUs)."""
    transport = proto.transport if proto is not None else None
    if transport is None:
        return False
    return same_host(transport.get_extra_info("peername"), transport.get_extra_info("sockname"))


def _write_ready(fd: int, reply: HandshakeReply) -> None:
    """Write the one ready line and close the fd (a vanished reader is not our problem)."""
    try:
        data = msgspec.json.encode(reply) + b"\n"
        while data:
            n = os.write(fd, data)
            data = data[n:]
    except OSError as exc:
        log.error("cannot write the ready line: %s", exc)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def run(spec_path: str, ready_fd: int) -> int:
    """The whole session; returns the exit code."""
    try:
        with open(spec_path, "rb") as f:
            spec = msgspec.json.decode(f.read(), type=RunnerSpec, strict=True)
    except (OSError, msgspec.MsgspecError) as exc:
        _write_ready(
            ready_fd,
            HandshakeReply(ok=False, error=f"cannot start session: spec {spec_path}: {exc}"),
        )
        return 1
    # Take the deadline first: everything after counts against it.
    deadline = time.monotonic() + (spec.deadline_unix - time.time())
    _mb.set_pdeathsig(signal.SIGTERM)
    # Started with -I: only the interpreter's own paths are on sys.path; the configured
    # job directories go in front of them, in order (what PYTHONPATH would have done).
    sys.path[0:0] = [entry for entry in dict.fromkeys(spec.python_path) if entry not in sys.path]
    runner = SessionRunner(spec, deadline)
    try:
        try:
            command, health = runner.bring_up()
        except StartFailure as exc:
            log.error("worker %d: %s", runner.worker_id, exc)
            _write_ready(ready_fd, HandshakeReply(ok=False, error=clip_text(str(exc))))
            return 1
        _write_ready(
            ready_fd, HandshakeReply(ok=True, command=command, health=health, pid=os.getpid())
        )
        import uvloop

        loop = uvloop.new_event_loop()
        try:
            return loop.run_until_complete(runner.serve())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            runner.loop = None
            loop.close()
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="simpler-remote-l3-session",
        description="One remote L3 session (started by simpler-remote-worker, not by hand).",
    )
    parser.add_argument("--spec", required=True, help="JSON spec file written by the worker")
    parser.add_argument("--ready-fd", type=int, required=True, help="fd for the ready line")
    ns = parser.parse_args(argv)
    faulthandler.enable()
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"simpler-remote-l3-session[{os.getpid()}] %(levelname)s %(message)s",
    )
    sys.exit(run(ns.spec, ns.ready_fd))


if __name__ == "__main__":
    main()
