"""``simpler-remote-worker``: serves remote L3 sessions to L4 parents on other hosts.

::

    simpler-remote-worker serve [--config FILE] [--listen HOST:PORT] [--token-file FILE]
                                [--insecure] [--set section.key=value ...]
    simpler-remote-worker check-config [--insecure] FILE
    simpler-remote-worker --version

Per connection (each one isolated; see :mod:`simpler_daemon.remote.manifest`)::

    accept: counted per source and in all (:mod:`.admission`), before TLS
    -> TLS (if configured) -> token, compared in constant time -> manifest, validated
       (all three within sessions.handshake_timeout)
    -> one runner exec'ed in its own process group -> ready line within the deadline
    -> reply {"ok": true, "command", "health", "pid"} | {"ok": false, "error"}

The runner (``python -I -m simpler_daemon.remote_worker.session --spec FILE --ready-fd N``)
is exec'ed, never forked from this process: the event loop may have threads. It runs
isolated (``-I``): the working directory and PYTHON* variables do not reach its
``sys.path``; ``callables.python_path`` is put in front of it explicitly. A
runner that fails to start, or whose session ends, is reclaimed with its whole
process group (SIGTERM, ``sessions.kill_grace``, SIGKILL). SIGTERM stops every
runner the same way (``worker.shutdown_grace``) and exits 0.

Exit status: 0 clean stop, 2 configuration error, 3 start-up failure (the port
cannot be bound).

Test hook: the environment variable ``SIMPLER_REMOTE_RUNNER_ARGV`` (a JSON list of
strings) replaces ``[python, "-I", "-m", "simpler_daemon.remote_worker.session"]``;
``--spec FILE --ready-fd N`` are still appended. It exists so tests can stand in a runner that
misbehaves (never ready, crashes); a warning is logged when it is set.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from simpler_daemon import __version__
from simpler_daemon.errors import ConfigError, ManifestError, ProtocolError, StartupError
from simpler_daemon.remote.manifest import (
    HandshakeReply,
    Manifest,
    decode_manifest,
    decode_reply,
    encode_lp_json,
    format_host_port,
    read_auth,
    read_lp,
    validate_manifest,
)
from simpler_daemon.remote_worker import config as cfg
from simpler_daemon.remote_worker.admission import (
    ERROR_TEXT_LIMIT,
    Admission,
    FailurePacing,
    Pending,
    abort,
    listen_socket,
    refuse,
)
from simpler_daemon.remote_worker.launch import runner_env, same_host, write_runner_spec
from simpler_daemon.system.configfile import add_set_option, overrides_from_set

# The exit statuses of simpler-daemon: units of both rely on 3 = cannot start.
from simpler_daemon.system.exitcodes import EXIT_CONFIG, EXIT_OK, EXIT_STARTUP
from simpler_daemon.system.logsetup import configure_logging
from simpler_daemon.system.notify import SystemdNotifier

__all__ = [
    "EXIT_CONFIG",
    "EXIT_OK",
    "EXIT_STARTUP",
    "RUNNER_ARGV_ENV",
    "RemoteWorkerService",
    "SessionInfo",
    "main",
]

#: Test hook: a JSON list replacing the runner command (see the module docstring).
RUNNER_ARGV_ENV: Final = "SIMPLER_REMOTE_RUNNER_ARGV"
_RUNNER_MODULE: Final = "simpler_daemon.remote_worker.session"

# A ready line is ~100 bytes; anything near this is a broken runner.
_READY_LINE_LIMIT: Final = 64 << 10
# Lines of runner output kept for the error a failed start reports.
_OUTPUT_TAIL_LINES: Final = 20
_WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})

log = logging.getLogger("simpler_daemon.remote.worker")


@dataclass(slots=True)
class SessionInfo:
    """One session in the worker's table, from spawn until its runner is reaped."""

    session_id: int
    worker_id: int
    peer: str
    #: The handshake came from this host (``launch.same_host``): told to the runner.
    local_parent: bool = False
    started: float = field(default_factory=time.time)
    pid: int | None = None
    state: str = "starting"
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    output: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_OUTPUT_TAIL_LINES), repr=False
    )
    pump: asyncio.Task[None] | None = field(default=None, repr=False)


class _Refused(Exception):
    """Ends a connection with ``{"ok": false, "error": str(exc)}``."""


class _AuthFailed(_Refused):
    """A wrong token: counted against the peer's host (``FailurePacing``)."""


class _StartFailed(Exception):
    """The runner did not become ready; the error gets its exit status and output tail
    once its process group has been reclaimed."""

    def __init__(self, reason: str, *, exit_status: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_status = exit_status


class RemoteWorkerService:
    """The listener, the session table and the runners' lifecycle. One per process."""

    def __init__(
        self,
        config: cfg.RemoteWorkerConfig,
        credentials: cfg.Credentials,
        *,
        notifier: SystemdNotifier | None = None,
        runner_argv: Sequence[str] | None = None,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._token = credentials.token
        self._ssl = credentials.ssl_context
        #: Counts wrong tokens per source; a source over the limit gets its wrong tokens
        #: answered late (never its correct ones refused).
        self.auth_pacing = FailurePacing()
        self._limits = cfg.manifest_limits(config)
        self.notifier = notifier or SystemdNotifier(None)
        # -I: the runner's sys.path holds neither the working directory nor PYTHON*
        # variables (a module planted there must not run inside a session); the runner
        # adds callables.python_path itself.
        self._runner_argv = list(runner_argv or (sys.executable, "-I", "-m", _RUNNER_MODULE))
        self._announce = announce or _print
        self.sessions: dict[int, SessionInfo] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Connections in their handshake, by source address, and their limits.
        self.admission = Admission(
            config.sessions.max_connections, config.sessions.max_connections_per_source
        )
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self.address: tuple[str, int] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(self) -> int:
        """Listen until SIGTERM/SIGINT, then stop every runner; returns 0.

        ``StartupError`` when the listener cannot be bound.
        """
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_exception_handler)
        self._stop_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_event.set)
        host, port = self.config.listen_address
        try:
            listener = listen_socket(host, port)
        except OSError as exc:
            raise StartupError(
                f"cannot listen on {self.config.worker.listen}: {exc.strerror or exc}"
            ) from exc
        acceptor = asyncio.create_task(self._accept(listener), name="accept")
        bound = listener.getsockname()
        self.address = (bound[0], bound[1])
        where = format_host_port(bound[0], bound[1])
        self._announce(f"listening on {where}")
        log.info(
            "listening on %s (tls %s, token %s)",
            where,
            "on" if self._ssl else "off",
            "on" if self._token else "off",
        )
        self.notifier.ready(f"listening on {where}, 0 sessions")
        watchdog: asyncio.Task[None] | None = None
        period = self.notifier.ping_period()
        if self.config.worker.watchdog and period:
            watchdog = asyncio.create_task(self._watchdog(period), name="watchdog")
        try:
            await self._stop_event.wait()
        finally:
            self._stopping = True
            self.notifier.stopping(f"stopping: {len(self.sessions)} sessions")
            log.info("stopping: %d sessions", len(self.sessions))
            acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acceptor
            listener.close()
            await self._stop_sessions()
            if watchdog is not None:
                watchdog.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watchdog
        log.info("stopped")
        return EXIT_OK

    def stop(self) -> None:
        """Ask :meth:`serve` to stop (what SIGTERM does)."""
        if self._stop_event is not None:
            self._stop_event.set()

    async def _watchdog(self, period: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(period)

    async def _stop_sessions(self) -> None:
        """SIGTERM every runner's group, wait ``shutdown_grace``, SIGKILL what is left."""
        session_tasks = {t for t in self._tasks if t.get_name().startswith("session-")}
        for t in self._tasks - session_tasks:
            t.cancel()  # still in their handshake: they own no process
        for s in list(self.sessions.values()):
            if s.pid is not None:
                _killpg(s.pid, signal.SIGTERM)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.worker.shutdown_grace)
        for s in list(self.sessions.values()):
            if s.pid is not None and s.process is not None:
                if s.process.returncode is None:
                    log.warning(
                        "session %d: runner %d ignored SIGTERM; killing", s.session_id, s.pid
                    )
                _killpg(s.pid, signal.SIGKILL)
        # Every remaining task waits only for a SIGKILLed process or a cancelled read.
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def _status(self) -> None:
        self.notifier.status(f"{len(self.sessions)} sessions")

    # -- one connection ------------------------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        """Accept connections and admit each one (``_admit``) before a byte is read."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: the next accept may work
                log.warning("cannot accept a connection: %s", exc.strerror or exc)
                await asyncio.sleep(0.1)
                continue
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        """Count the connection (``Admission``) and start its handshake."""
        host = addr[0] if isinstance(addr, tuple) and addr else "?"
        peer = format_host_port(addr[0], addr[1]) if isinstance(addr, tuple) else "?"
        hs, refused = self.admission.admit(host, peer)
        task = asyncio.create_task(self._connection(conn, hs, refused), name="handshake")
        hs.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, conn: socket.socket, hs: Pending, refused: str) -> None:
        loop = asyncio.get_running_loop()
        peer = hs.peer
        log.debug("connection from %s", peer)
        s = self.config.sessions
        reader = asyncio.StreamReader(limit=_READY_LINE_LIMIT)
        protocol = asyncio.StreamReaderProtocol(reader)
        writer: asyncio.StreamWriter | None = None
        try:
            # One deadline for all of it: the TLS handshake, the token and the manifest.
            async with asyncio.timeout(s.handshake_timeout) as deadline:
                try:
                    transport, _ = await loop.connect_accepted_socket(
                        lambda: protocol,
                        conn,
                        ssl=self._ssl,
                        ssl_handshake_timeout=s.handshake_timeout if self._ssl else None,
                    )
                except (OSError, ssl.SSLError) as exc:
                    log.debug("connection from %s: TLS handshake failed: %s", peer, exc)
                    return
                writer = asyncio.StreamWriter(transport, protocol, reader, loop)
                if self._stopping:
                    raise _Refused("cannot open session: the worker is stopping")
                if refused:
                    raise _Refused(refused)
                manifest = await self._handshake(reader, hs)
                deadline.reschedule(None)
            self.admission.forget(hs)
            await self._session(manifest, peer, writer)
        except TimeoutError:
            if writer is None:
                log.debug("connection from %s: no TLS handshake within the deadline", peer)
                return
            log.info("refused %s: handshake not completed in time", peer)
            await refuse(
                reader,
                writer,
                f"cannot open session: handshake not completed within {s.handshake_timeout:g}s "
                "(sessions.handshake_timeout)",
            )
        except _AuthFailed as exc:
            assert writer is not None
            await self._auth_failed(hs, reader, writer, str(exc))
        except _Refused as exc:
            log.info("refused %s: %s", peer, exc)
            if writer is not None:
                await refuse(reader, writer, str(exc))
        except asyncio.CancelledError:
            if writer is not None:
                abort(writer)
            if not hs.evicted:
                raise
        except Exception:
            # A bug must not take the listener or another connection down.
            log.exception("connection from %s failed", peer)
            if writer is not None:
                abort(writer)
        finally:
            self.admission.forget(hs)
            if writer is not None:
                writer.close()
            else:
                conn.close()

    async def _auth_failed(
        self,
        hs: Pending,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        error: str,
    ) -> None:
        """Count a wrong token; answer it late when its source failed too often. The
        source is never refused: its next token is compared as usual."""
        delay = self.auth_pacing.failed(hs.host, hs.peer, error)
        if delay:
            await asyncio.sleep(delay)
        await refuse(reader, writer, error)

    async def _handshake(self, reader: asyncio.StreamReader, hs: Pending) -> Manifest:
        """Token, then manifest (the caller bounds both with the handshake deadline)."""
        s = self.config.sessions
        try:
            token = await read_auth(reader)
            if not hmac.compare_digest(token, self._token):
                raise _AuthFailed("cannot open session: authentication failed")
            hs.authenticated = True  # from here on it is a parent's: never evicted
            log.debug("connection from %s: authenticated", hs.peer)
            data = await read_lp(reader, s.max_manifest_bytes)
        except ProtocolError as exc:
            raise _Refused(f"cannot open session: {exc}") from None
        except OSError as exc:  # a reset, or a TLS record error after the TLS handshake
            raise _Refused(f"cannot open session: {exc}") from None
        try:
            manifest = decode_manifest(data)
            validate_manifest(manifest, self._limits)
        except ManifestError as exc:
            raise _Refused(str(exc)) from None
        return manifest

    # -- one session ---------------------------------------------------------------------

    async def _session(
        self,
        m: Manifest,
        peer: str,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Start the runner, answer the parent, then watch the runner until it exits."""
        if self._stopping:
            raise _Refused("cannot open session: the worker is stopping")
        limit = self.config.sessions.max
        if len(self.sessions) >= limit:
            raise _Refused(
                f"cannot open session: {len(self.sessions)} sessions already running "
                "(limit sessions.max)"
            )
        if m.session_id in self.sessions:
            raise _Refused(f"cannot open session: session id {m.session_id} is already in use")
        task = asyncio.current_task()
        assert task is not None
        task.set_name(f"session-{m.session_id}")  # from here on it may own a process
        info = SessionInfo(
            m.session_id,
            m.worker_id,
            peer,
            same_host(writer.get_extra_info("peername"), writer.get_extra_info("sockname")),
        )
        self.sessions[m.session_id] = info
        self._status()
        try:
            try:
                reply = await self._start_runner(m, info)
            except _Refused as exc:
                await self._reclaim(info)
                reply = HandshakeReply(ok=False, error=str(exc)[:ERROR_TEXT_LIMIT])
            except _StartFailed as exc:
                await self._reclaim(info)
                await self._finish_pump(info)
                reply = HandshakeReply(ok=False, error=self._start_failure(info, exc))
            if reply.ok:
                sockname = writer.get_extra_info("sockname")
                local = sockname[0] if sockname else self.config.listen_address[0]
                reply = msgspec.structs.replace(
                    reply,
                    command=_reachable(reply.command, local),
                    health=_reachable(reply.health, local),
                )
                info.state = "running"
                log.info(
                    "session %d opened: worker %d, peer %s, runner pid %s, command %s",
                    m.session_id,
                    m.worker_id,
                    peer,
                    info.pid,
                    reply.command,
                )
            else:
                log.info("session %d refused (peer %s): %s", m.session_id, peer, reply.error)
            # The parent may be gone already: the runner then misses its attach deadline.
            with contextlib.suppress(ConnectionError, TimeoutError, OSError):
                writer.write(encode_lp_json(reply))
                async with asyncio.timeout(self.config.sessions.handshake_timeout):
                    await writer.drain()
            writer.close()
            if reply.ok and info.process is not None:
                code = await info.process.wait()
                log.info(
                    "session %d closed: runner pid %s exited with %s after %.1fs",
                    m.session_id,
                    info.pid,
                    _describe_exit(code),
                    time.time() - info.started,
                )
        finally:
            await self._reclaim(info)
            await self._finish_pump(info)
            self.sessions.pop(m.session_id, None)
            self._status()

    async def _start_runner(self, m: Manifest, info: SessionInfo) -> HandshakeReply:
        """Exec the runner and wait for its ready line until the session's deadline.

        Returns the runner's ``ok`` reply. Raises ``_StartFailed`` when the runner did not
        get ready, ``_Refused`` when it could not be started or said ``ok: false``; the
        caller reclaims the process group either way.
        """
        s = self.config.sessions
        # A manifest that names no start-up budget gets its session timeout.
        budget = min(m.startup_bound_s(), s.max_startup)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        try:
            spec_path = write_runner_spec(
                self.config, m, time.time() + budget, parent_on_this_host=info.local_parent
            )
        except OSError as exc:
            raise _Refused(
                f"cannot open session: cannot write the runner spec file: {exc.strerror or exc}"
            ) from exc
        ready_r = ready_w = out_r = out_w = -1
        transport: asyncio.BaseTransport | None = None
        try:
            ready_r, ready_w = os.pipe()
            out_r, out_w = os.pipe()
            argv = [*self._runner_argv, "--spec", spec_path, "--ready-fd", str(ready_w)]
            try:
                info.process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=out_w,
                    pass_fds=(ready_w,),
                    start_new_session=True,
                    env=runner_env(self.config, RUNNER_ARGV_ENV),
                )
            except OSError as exc:
                raise _Refused(
                    f"cannot open session: cannot start the session runner {argv[0]}: "
                    f"{exc.strerror or exc}"
                ) from exc
            info.pid = info.process.pid
            os.close(ready_w)
            os.close(out_w)
            ready_w = out_w = -1
            info.pump = asyncio.create_task(_pump_output(out_r, info), name=f"output-{info.pid}")
            out_r = -1  # the pump owns it
            if self._stopping:
                raise _Refused("cannot open session: the worker is stopping")
            ready = asyncio.StreamReader(limit=_READY_LINE_LIMIT)
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(ready), os.fdopen(ready_r, "rb", buffering=0)
            )
            ready_r = -1  # the transport owns it
            try:
                async with asyncio.timeout_at(deadline):
                    line = await ready.readline()
            except TimeoutError:
                raise _StartFailed(f"the session runner was not ready within {budget:g}s") from None
            except ValueError:  # a line longer than the limit
                raise _StartFailed("the session runner wrote an oversize ready line") from None
            if not line.endswith(b"\n"):
                # EOF: the runner exited (or closed the pipe) without a ready line.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(info.process.wait(), max(0.0, deadline - loop.time()))
                raise _StartFailed(
                    "the session runner exited before it was ready", exit_status=True
                )
            try:
                reply = decode_reply(line.strip())
            except ProtocolError as exc:
                raise _StartFailed(f"the session runner's ready line is invalid: {exc}") from None
            if not reply.ok:
                error = reply.error
                if not error.startswith("cannot "):
                    error = f"cannot open session: {error}"
                raise _Refused(error)
            return msgspec.structs.replace(reply, pid=info.pid)
        finally:
            for fd in (ready_r, ready_w, out_r, out_w):
                if fd >= 0:
                    os.close(fd)
            if transport is not None:
                transport.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec_path)

    def _start_failure(self, info: SessionInfo, exc: _StartFailed) -> str:
        text = f"cannot open session: {exc.reason}"
        code = info.process.returncode if info.process is not None else None
        if exc.exit_status and code is not None:
            text += f" ({_describe_exit(code)})"
        tail = "\n".join(info.output)
        if tail:
            text += f"; runner output:\n{tail}"
        # The end of the output says most about why it failed.
        if len(text) > ERROR_TEXT_LIMIT:
            text = text[:200] + " ... " + text[-(ERROR_TEXT_LIMIT - 205) :]
        return text

    async def _finish_pump(self, info: SessionInfo) -> None:
        """Let the output pump reach EOF (the group is gone) so the tail is complete."""
        pump = info.pump
        if pump is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pump), 1.0)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump

    async def _reclaim(self, info: SessionInfo) -> None:
        """End the runner's whole process group: SIGTERM, grace, SIGKILL; reap the runner."""
        proc = info.process
        if proc is None or info.pid is None:
            return
        if proc.returncode is None:
            _killpg(info.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), self.config.sessions.kill_grace)
        # Also after a clean exit: nothing of the session's group may outlive it.
        _killpg(info.pid, signal.SIGKILL)
        await proc.wait()


# --------------------------------------------------------------------------- helpers


async def _pump_output(fd: int, info: SessionInfo) -> None:
    """Log the runner's stdout/stderr line by line and keep the last lines for errors."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_READY_LINE_LIMIT)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    try:
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # an overlong line: keep its start
                line = (await reader.read(_READY_LINE_LIMIT))[:ERROR_TEXT_LIMIT]
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip()
            info.output.append(text)
            log.info("session %d runner %s: %s", info.session_id, info.pid, text)
    finally:
        transport.close()


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _print(line: str) -> None:
    print(line, flush=True)


def _reachable(address: str, local_host: str) -> str:
    """A runner bound to a wildcard reports 0.0.0.0: give the parent the address it used."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") in _WILDCARDS:
        return format_host_port(local_host, int(port))
    return address


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _quiet_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Failed TLS handshakes and resets from scanners are routine on a listener: debug only."""
    exc = context.get("exception")
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)) or (
        exc is not None and type(exc).__module__ == "ssl"
    ):
        log.debug("connection error: %s: %s", context.get("message"), exc)
        return
    loop.default_exception_handler(context)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="simpler-remote-worker",
        description="Serve remote L3 sessions (simpler-remote-l3-session runners) to L4 parents.",
    )
    ap.add_argument("--version", action="version", version=f"simpler-remote-worker {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the worker in the foreground")
    serve.add_argument("--config", metavar="FILE", help="TOML configuration (default: defaults)")
    serve.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"address to listen on (worker.listen, default {cfg.DEFAULT_LISTEN}; port 0 = any)",
    )
    serve.add_argument("--token-file", metavar="FILE", help="bearer token file (auth.token_file)")
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback listener without TLS and a token (trusted networks only)",
    )
    add_set_option(serve, example="sessions.max=4")
    check = sub.add_parser("check-config", help="validate a configuration file and exit")
    check.add_argument("--insecure", action="store_true", help="as for serve")
    check.add_argument("file", metavar="FILE")
    return ap


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out = overrides_from_set(args.set)
    # Flags win over --set: they are the more specific spelling.
    # Text settings take the text as written (no TOML quoting needed or applied).
    if args.listen is not None:
        out["worker.listen"] = args.listen
    if args.token_file is not None:
        out["auth.token_file"] = os.path.abspath(args.token_file)
    return out


def _err(text: str) -> None:
    print(f"simpler-remote-worker: {text}", file=sys.stderr, flush=True)


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = cfg.load(args.file, insecure=args.insecure)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    print(
        f"{args.file}: ok (listen {config.worker.listen}, "
        f"tls {'on' if config.tls_enabled else 'off'}, "
        f"token {'on' if config.auth.token_file else 'off'}, "
        f"up to {config.sessions.max} sessions)",
        flush=True,
    )
    return EXIT_OK


def _runner_argv_from_env() -> list[str] | None:
    text = os.environ.get(RUNNER_ARGV_ENV)
    if not text:
        return None
    try:
        argv = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{RUNNER_ARGV_ENV}: not JSON: {exc}", key=RUNNER_ARGV_ENV) from None
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ConfigError(
            f"{RUNNER_ARGV_ENV}: must be a non-empty JSON list of strings", key=RUNNER_ARGV_ENV
        )
    log.warning("%s is set: runners are started as %s (a test hook)", RUNNER_ARGV_ENV, argv)
    return argv


def _serve(args: argparse.Namespace) -> int:
    try:
        config = cfg.load(args.config, overrides=_overrides(args), insecure=args.insecure)
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    configure_logging(config.worker.log_format, config.worker.log_level)
    try:
        credentials = cfg.load_credentials(config)
        runner_argv = _runner_argv_from_env()
        spec_dir = config.worker.spec_dir
        if spec_dir and not os.path.isdir(spec_dir):
            raise ConfigError(
                f"worker.spec_dir: {spec_dir} is not a directory", key="worker.spec_dir"
            )
    except ConfigError as exc:
        _err(str(exc))
        return EXIT_CONFIG
    if args.insecure and not cfg.is_loopback(config.listen_address[0]):
        log.warning(
            # Not "listening on": that line is the ready signal, printed once bound.
            "--insecure: %s is served without %s",
            config.worker.listen,
            " and ".join(
                w
                for w, have in (("TLS", config.tls_enabled), ("a token", bool(credentials.token)))
                if not have
            )
            or "nothing missing",
        )
    # Runners must not speak for the worker to systemd (NotifyAccess=main anyway).
    notifier = SystemdNotifier.from_env(unset=True)
    service = RemoteWorkerService(config, credentials, notifier=notifier, runner_argv=runner_argv)
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(service.serve())
    except StartupError as exc:
        _err(str(exc))
        return EXIT_STARTUP
    finally:
        notifier.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``simpler-remote-worker`` console script; returns the exit status."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "serve":
        return _serve(args)
    ap.print_usage(sys.stderr)
    _err("a command is required: serve or check-config")
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
