"""Prometheus metrics of the daemon and the asyncio listener that serves them.

The registry is the daemon's own (never ``prometheus_client``'s global one), so
several daemons in one process (tests) do not collide. ``/metrics`` is served by
a small HTTP/1.1 responder on the daemon's event loop::

    Prometheus --GET /metrics--> asyncio.start_server --> generate_latest(registry)

so no thread is started (see the fork rule: threads only after the last fork,
and none that the daemon does not need).

Counters, gauges and the latency histogram are recorded as things happen; the state
an operator alerts on (heap, buffers, runs by state, each worker child's CPU and
memory) is read at scrape time (:class:`DaemonCollector`, ``watch_daemon``). What is
exposed leaves out the ``_created`` samples ``prometheus_client`` adds to counters and
histograms (:class:`_WithoutCreated`). Metrics are off unless ``metrics.listen`` is set.

The listener cannot starve the daemon of file descriptors: at most
``max_connections`` (64) are served at once (more are closed at accept), and each
gets ``idle_timeout`` (10 s) to send its request and read the answer. With a
``token`` every request must carry ``Authorization: Bearer <token>`` (401 otherwise,
compared in constant time). With ``[dashboard] enabled`` every other path is the
status page's (server/dashboard.py, :meth:`Metrics.serve_dashboard`), behind the same
token.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import os
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from simpler_daemon import __version__
from simpler_daemon.server.task_tally import TaskTally

__all__ = [
    "IDLE_TIMEOUT",
    "LATENCY_BUCKETS",
    "MAX_CONNECTIONS",
    "DaemonCollector",
    "Metrics",
    "RemoteWorkerCollector",
]

logger = logging.getLogger(__name__)

#: Task latency buckets in seconds: 10 µs to 10 s, three per decade.
LATENCY_BUCKETS: Final = (
    0.00001, 0.000025, 0.00005,
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0,
)  # fmt: skip

_MAX_REQUEST_HEAD: Final = 16 * 1024
#: Scrape connections served at once; more are closed at accept.
MAX_CONNECTIONS: Final = 64
#: Seconds a connection has to send its request and take the answer.
IDLE_TIMEOUT: Final = 10.0
_CLOSE_TIMEOUT: Final = 5.0
_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


#: The session states of a remote worker's row (``simpler_remote_state``).
_REMOTE_STATES: Final = ("ready", "failed", "reconnecting", "closed", "retired")


class RemoteWorkerCollector(Collector):
    """Per remote L3 worker: health age, command round trip, failures, reconnects, and
    its session's state (one ``state`` label set to 1), the reconnect attempts of the
    outage under way and the seconds to the next one (only while one waits).

    Read from ``rows()`` (``Worker.list_workers``) at scrape time, so the values
    are the endpoint's own counters and nothing has to be pushed; scrapes run on
    the event loop, where the Worker may be read.
    """

    def __init__(self, rows: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self._rows = rows

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        health, rtt, failures, reconnects, state, attempts, next_try = self._families()
        try:
            rows = [r for r in self._rows() if r.get("kind") == "remote"]
        except Exception:  # a scrape never fails the daemon; the gauges are just absent
            logger.exception("cannot collect remote worker metrics")
            rows = []
        for row in rows:
            worker = str(row.get("worker_id", ""))
            health.add_metric([worker], float(row.get("health_age_s") or 0.0))
            rtt.add_metric([worker], float(row.get("round_trip_us") or 0.0) / 1e6)
            failures.add_metric([worker], float(row.get("failures") or 0))
            reconnects.add_metric([worker], float(row.get("reconnects") or 0))
            now = str(row.get("state") or "")
            for name in _REMOTE_STATES:
                state.add_metric([worker, name], 1.0 if name == now else 0.0)
            attempts.add_metric([worker], float(row.get("attempts") or 0))
            if row.get("next_try_s") is not None:
                next_try.add_metric([worker], float(row["next_try_s"]))
        yield from (health, rtt, failures, reconnects, state, attempts, next_try)

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            GaugeMetricFamily(
                "simpler_remote_health_age_seconds",
                "Seconds since the remote worker's last HEALTH frame.",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "simpler_remote_round_trip_seconds",
                "Round trip of the remote worker's last command.",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "simpler_remote_failures",
                "Failures of the remote worker (session and command).",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "simpler_remote_reconnects",
                "Sessions re-opened to the remote worker after a failure.",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "simpler_remote_state",
                "1 for the remote worker's session state (ready, failed, reconnecting, retired, "
                "closed), 0 for the others.",
                labels=["worker", "state"],
            ),
            GaugeMetricFamily(
                "simpler_remote_reconnect_attempts",
                "Reconnect attempts started in the remote worker's outage under way.",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "simpler_remote_next_try_seconds",
                "Seconds until the next reconnect attempt (only while one waits).",
                labels=["worker"],
            ),
        )


_DISCOVERY_STATES: Final = ("active", "opening", "retired", "static")


class DiscoveryCollector(Collector):
    """``[workers.discovery]``: the addresses of the last answer, resolutions and their
    failures, the time of the last resolution and the addresses per state, read from
    ``view()`` (``Discovery.view``) at scrape time."""

    def __init__(self, view: Callable[[], dict[str, Any]]) -> None:
        self._view = view

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        addresses, resolutions, failures, last, workers = families = self._families()
        try:
            view = self._view()
        except Exception:  # a scrape never fails the daemon
            logger.exception("cannot collect discovery metrics")
            return
        rows = view["addresses"]
        addresses.add_metric([], float(len(view["answer"])))
        resolutions.add_metric([], float(view["resolutions"]))
        failures.add_metric([], float(view["failures"]))
        last.add_metric([], float(view["last_resolve"]))
        for state in _DISCOVERY_STATES:
            workers.add_metric([state], float(sum(r["state"] == state for r in rows)))
        yield from families

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            GaugeMetricFamily(
                "simpler_discovery_addresses",
                "Addresses of the discovery name in its last answer.",
            ),
            CounterMetricFamily(
                "simpler_discovery_resolutions", "Resolutions of the discovery name finished."
            ),
            CounterMetricFamily(
                "simpler_discovery_resolve_failures",
                "Resolutions of the discovery name that failed (the workers stayed as they were).",
            ),
            GaugeMetricFamily(
                "simpler_discovery_last_resolve_timestamp_seconds",
                "Unix time of the last resolution of the discovery name (0: none yet).",
            ),
            GaugeMetricFamily(
                "simpler_discovery_workers",
                "Addresses discovery has seen, by state (active, opening, retired, static).",
                labels=["state"],
            ),
        )


class DaemonCollector(Collector):
    """What an operator alerts on, read at scrape time (nothing is pushed or polled):

    * the shared heap: size, used, free and largest free block (a heap with free bytes
      but no block as large as the next buffer refuses it all the same), live buffers;
    * runs by state (``run_counts()``, ``RunTable.state_counts``): queued, active, and the
      finished ones the daemon keeps (completed, failed, cancelled, lost);
    * per local worker child (SUB, chip, local L3): CPU seconds and resident memory,
      from ``/proc/<pid>/stat`` and ``/proc/<pid>/statm``;
    * the objects the daemon's garbage collector tracks (``gc.get_objects()``, a few ms
      per scrape): flat while the daemon keeps what it should, growing when it leaks.

    Scrapes run on the event loop, where the Worker may be read.
    """

    def __init__(
        self, worker: Any, run_counts: Callable[[], Mapping[str, int]] | None = None
    ) -> None:
        self._worker = worker
        self._run_counts = run_counts

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        size, used, free, largest, buffers, runs, cpu, rss, objects = self._families()
        # What the daemon keeps shows here first (a finished run's task slots did, issue
        # 14.2): frozen objects (gc.freeze() after start) are outside get_objects().
        objects.add_metric([], float(len(gc.get_objects()) + gc.get_freeze_count()))
        try:
            heap = self._worker.heap
            free_bytes = heap.free_bytes()
            size.add_metric([], float(heap.size))
            used.add_metric([], float(heap.size - free_bytes))
            free.add_metric([], float(free_bytes))
            largest.add_metric([], float(heap.largest_free()))
            buffers.add_metric([], float(len(heap.buffers())))
        except Exception:  # a scrape never fails the daemon (a closed heap): series absent
            logger.exception("cannot collect heap metrics")
        if self._run_counts is not None:
            try:
                for state, count in self._run_counts().items():
                    runs.add_metric([state], float(count))
            except Exception:
                logger.exception("cannot collect run metrics")
        try:
            rows = [r for r in self._worker.list_workers() if r.get("kind") != "remote"]
        except Exception:
            logger.exception("cannot collect worker child metrics")
            rows = []
        for row in rows:
            pid = row.get("pid")
            if not pid or not row.get("alive", True):
                continue
            usage = child_usage(int(pid))
            if usage is None:  # exited between the listing and the read
                continue
            labels = [str(row.get("kind", "")), str(row.get("worker_id", ""))]
            cpu.add_metric(labels, usage[0])
            rss.add_metric(labels, usage[1])
        yield from (size, used, free, largest, buffers, runs, cpu, rss, objects)

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            GaugeMetricFamily("simpler_daemon_heap_size_bytes", "Size of the shared heap."),
            GaugeMetricFamily(
                "simpler_daemon_heap_used_bytes", "Bytes of the shared heap held by buffers."
            ),
            GaugeMetricFamily("simpler_daemon_heap_free_bytes", "Free bytes of the shared heap."),
            GaugeMetricFamily(
                "simpler_daemon_heap_largest_free_block_bytes",
                "Largest contiguous free block of the shared heap: the largest buffer that "
                "can be allocated now.",
            ),
            GaugeMetricFamily("simpler_daemon_buffers", "Buffers allocated on the shared heap."),
            GaugeMetricFamily(
                "simpler_daemon_runs_in_state",
                "Runs the daemon knows, by state (finished ones as far as they are kept: "
                "limits.max_finished_runs_kept).",
                labels=["state"],
            ),
            CounterMetricFamily(
                "simpler_daemon_child_cpu_seconds",
                "CPU time (user + system) of a worker child; restarts from 0 when the child "
                "is replaced.",
                labels=["kind", "worker"],
            ),
            GaugeMetricFamily(
                "simpler_daemon_child_resident_memory_bytes",
                "Resident memory of a worker child (the shared heap pages it touched included).",
                labels=["kind", "worker"],
            ),
            GaugeMetricFamily(
                "simpler_daemon_gc_objects",
                "Objects the daemon process's garbage collector tracks (frozen ones included): "
                "grows with what the daemon keeps, e.g. finished runs.",
            ),
        )


_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE: Final = os.sysconf("SC_PAGE_SIZE")


def child_usage(pid: int) -> tuple[float, float] | None:
    """``(cpu seconds, resident bytes)`` of process ``pid`` from ``/proc``; None when it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/statm", "rb") as f:
            statm = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields count from the
    # last ")". utime and stime are fields 14 and 15.
    fields = stat.rpartition(b")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    resident = int(statm.split()[1]) * _PAGE_SIZE
    return cpu, float(resident)


class _WithoutCreated(CollectorRegistry):
    """The daemon's registry as it is exposed: without the ``<name>_created`` sample
    ``prometheus_client`` adds beside every counter and histogram child. In the text
    format each is one more series per label set, holding the process start time, which
    nobody alerts on (``PROMETHEUS_DISABLE_CREATED_SERIES`` would drop them process-wide;
    this keeps it to the daemon's registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(auto_describe=False)
        self._source = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._source.collect():
            created = metric.name + "_created"
            samples = [s for s in metric.samples if s.name != created]
            if len(samples) != len(metric.samples):
                copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                copy.samples = samples
                metric = copy
            yield metric


class Metrics:
    """Counters, gauges and the latency histogram of one daemon, plus ``/metrics``.

    The recording methods are cheap and synchronous. The per-task ones
    (``task_dispatched``, ``task_completed``, ``observe_task_latency``) count in plain
    integers: call them on the event loop only, as the Scheduler's task events are.
    The others may be called from any thread (``prometheus_client`` values are
    lock-protected).
    """

    def __init__(
        self,
        *,
        namespace: str = "simpler_daemon",
        runtime_metrics: bool = True,
        token: bytes | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        """``runtime_metrics`` adds the standard ``process_*`` and ``python_*`` collectors;
        ``token`` (non-empty) makes the listener require ``Authorization: Bearer <token>``;
        ``max_connections`` and ``idle_timeout`` bound what scrapers may hold open."""
        if max_connections < 1 or not idle_timeout > 0:
            raise ValueError(
                f"cannot create Metrics: max_connections={max_connections}, "
                f"idle_timeout={idle_timeout}"
            )
        self._expected_auth = b"Bearer " + token if token else None
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        #: Connections closed at accept because ``max_connections`` were open.
        self.refused_connections = 0
        self._at_capacity = False
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        ns = namespace
        # The per-task counts: plain integers on the loop, rendered at scrape
        # (task_tally.py: prometheus_client children cost ~48 calls per task).
        self._tally = TaskTally(ns, LATENCY_BUCKETS)
        reg.register(self._tally)
        self._runs = Counter(
            "runs", "Runs that finished, by outcome.", ["outcome"], namespace=ns, registry=reg
        )
        self._queue_depth = Gauge(
            "queue_depth",
            "Tasks waiting in a scheduler queue.",
            ["queue"],
            namespace=ns,
            registry=reg,
        )
        self._runs_queued = Gauge(
            "runs_queued",
            "Runs of a client waiting QUEUED past limits.per_client_runs (its per-client "
            "queue, bounded by limits.per_client_queued_runs).",
            ["client"],
            namespace=ns,
            registry=reg,
        )
        self._lanes = Gauge(
            "lanes",
            "Worker lanes by kind and state.",
            ["kind", "state"],
            namespace=ns,
            registry=reg,
        )
        self._restarts = Counter(
            "child_restarts",
            "Worker children replaced after they died.",
            ["kind"],
            namespace=ns,
            registry=reg,
        )
        self._grpc = Counter(
            "grpc_requests",
            "Finished gRPC calls by method and status code.",
            ["method", "code"],
            namespace=ns,
            registry=reg,
        )
        self._serving = Gauge(
            "serving",
            "1 while the daemon admits runs and every worker pool has capacity (gRPC health "
            "SERVING); 0 while it is unhealthy, draining or stopping.",
            namespace=ns,
            registry=reg,
        )
        self._pool_down = Gauge(
            "worker_pool_down",
            "1 while a worker pool has no live worker left and none is being replaced.",
            ["pool"],
            namespace=ns,
            registry=reg,
        )
        self._history_failures = Counter(
            "history_write_failures",
            "Writes to the run history (daemon.state_dir) that failed, e.g. on a full disk; "
            "the runs went on.",
            namespace=ns,
            registry=reg,
        )
        self._build = Info("build", "The daemon's version and Python.", namespace=ns, registry=reg)
        self._build.info({"version": __version__, "python": platform.python_version()})
        if runtime_metrics:
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
            GCCollector(registry=reg)
        #: What is served and rendered: the registry without ``_created`` series.
        self.exposed: CollectorRegistry = _WithoutCreated(reg)
        self._server: asyncio.Server | None = None
        # Open scrape connections: close() aborts their transports (cancelling the
        # handler tasks instead trips a 3.11 streams bug that logs the cancellation).
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._closed = False
        self._dashboard: Any = None

    # ------------------------------------------------------------------ recording

    def task_dispatched(self, kind: str) -> None:
        """A task of ``kind`` (``sub``, ``chip``, ``next_level``...) was published (on
        the loop, as every per-task count)."""
        self._tally.task_dispatched(kind)

    def task_completed(self, kind: str, outcome: str, latency: float | None = None) -> None:
        """A task finished with ``outcome``; ``latency`` (seconds since dispatch) is observed."""
        self._tally.task_completed(kind, outcome, latency)

    def observe_task_latency(self, kind: str, seconds: float) -> None:
        """Record one dispatch-to-completion time without counting a completion."""
        self._tally.observe(kind, seconds)

    def run_finished(self, outcome: str) -> None:
        """A run reached ``outcome`` (``completed``, ``failed``, ``cancelled``)."""
        self._runs.labels(outcome).inc()

    def set_queue_depth(self, queue: str, depth: int) -> None:
        self._queue_depth.labels(queue).set(depth)

    def set_runs_queued(self, client: str, count: int) -> None:
        """``client``'s runs waiting in its queue; 0 drops the client's series."""
        if count:
            self._runs_queued.labels(client).set(count)
        else:
            with contextlib.suppress(KeyError):
                self._runs_queued.remove(client)

    def set_lanes(self, kind: str, state: str, count: int) -> None:
        """How many lanes of ``kind`` are in ``state`` (``idle``, ``busy``, ``failed``...)."""
        self._lanes.labels(kind, state).set(count)

    def child_restarted(self, kind: str) -> None:
        self._restarts.labels(kind).inc()

    def history_write_failed(self) -> None:
        """A write to the run history failed (any thread)."""
        self._history_failures.inc()

    def set_serving(self, serving: bool) -> None:
        """Whether gRPC health reports SERVING (see server/health.py)."""
        self._serving.set(1 if serving else 0)

    def set_pool_down(self, pool: str, down: bool) -> None:
        """Whether worker pool ``pool`` (``sub``, ``chip``, ``l3``) has no capacity left."""
        self._pool_down.labels(pool).set(1 if down else 0)

    def grpc_request(self, method: str, code: str) -> None:
        """A gRPC call to ``method`` finished with status ``code`` (``OK``, ``NOT_FOUND``...)."""
        self._grpc.labels(method, code).inc()

    def watch_daemon(
        self, worker: Any, run_counts: Callable[[], Mapping[str, int]] | None = None
    ) -> None:
        """Export the heap, buffer, run-state and worker-child series of ``worker`` (and
        ``run_counts()``, ``RunTable.state_counts``) at each scrape
        (:class:`DaemonCollector`). Call once."""
        self.registry.register(DaemonCollector(worker, run_counts))

    def watch_remote_workers(self, rows: Callable[[], Iterable[dict[str, Any]]]) -> None:
        """Export the ``simpler_remote_*`` series of every ``kind == "remote"`` row of
        ``rows()`` (pass ``Worker.list_workers``) at each scrape. Call once."""
        self.registry.register(RemoteWorkerCollector(rows))

    def watch_discovery(self, view: Callable[[], dict[str, Any]]) -> None:
        """Export the ``simpler_discovery_*`` series of ``view()`` (``Discovery.view``)
        at each scrape. Call once."""
        self.registry.register(DiscoveryCollector(view))

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return bytes(generate_latest(self.exposed))

    # ------------------------------------------------------------------ listener

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every bound listener socket (empty before ``start``)."""
        if self._server is None:
            return []
        return [tuple(s.getsockname()[:2]) for s in self._server.sockets]

    @property
    def port(self) -> int | None:
        """The bound port (useful after ``start(host, 0)``), None when not listening."""
        addresses = self.addresses
        return addresses[0][1] if addresses else None

    async def start(self, host: str, port: int) -> None:
        """Listen for ``GET /metrics`` on ``host:port`` (port 0 picks a free one).

        Raises ``RuntimeError`` when already started or closed and ``OSError``
        when the address cannot be bound.
        """
        if self._closed:
            raise RuntimeError("cannot start metrics listener: closed")
        if self._server is not None:
            raise RuntimeError("cannot start metrics listener: already started")
        self._server = await asyncio.start_server(
            self._serve, host or None, port, limit=_MAX_REQUEST_HEAD, reuse_address=True
        )
        logger.info("metrics listening on %s", ", ".join(f"{h}:{p}" for h, p in self.addresses))

    async def close(self) -> None:
        """Stop listening and drop open scrape connections (bounded to a few seconds).

        Idempotent.
        """
        self._closed = True
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in self._connections.values():
            writer.transport.abort()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                if self._connections:
                    await asyncio.gather(*self._connections, return_exceptions=True)
                await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            # Closed at once: each open connection is a descriptor the gRPC server needs.
            self.refused_connections += 1
            if not self._at_capacity:
                self._at_capacity = True
                logger.warning(
                    "metrics listener: %d connections open (the limit); closing new ones "
                    "until some end",
                    len(self._connections),
                )
            writer.transport.abort()
            return
        self._at_capacity = False
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            if self._closed:  # accepted while close() ran
                return
            # One deadline for the request and the answer: a scraper that sends nothing,
            # or reads nothing, holds its descriptor for idle_timeout at most.
            async with asyncio.timeout(self.idle_timeout):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    await _respond(writer, 431, b"request head too large\n")
                    return
                except asyncio.IncompleteReadError:
                    return
                status, headers, body = await self._handle(
                    head, writer.get_extra_info("peername"), writer.get_extra_info("sockname")
                )
                await _respond(writer, status, body, headers)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def serve_dashboard(self, dashboard: Any) -> None:
        """Answer every path but ``/metrics`` with ``dashboard`` (server/dashboard.py), behind
        the same token. Call before :meth:`start`."""
        self._dashboard = dashboard

    async def _handle(
        self, head: bytes, peer: Any = None, local: Any = None
    ) -> tuple[int, dict[str, str], bytes]:
        request_line, *lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, {}, b"bad request line\n"
        method, target, _ = parts
        path = target.partition("?")[0]
        dashboard = self._dashboard if path != "/metrics" else None
        if self._expected_auth is not None:
            given = b""
            for line in lines:
                name, _, value = line.partition(":")
                if name.strip().lower() == "authorization":
                    given = value.strip().encode("latin-1")
            if not hmac.compare_digest(given, self._expected_auth):
                if dashboard is not None:
                    status, headers, body = dashboard.unauthorized(path)
                    return status, headers, b"" if method == "HEAD" else body
                return (
                    401,
                    {"WWW-Authenticate": 'Bearer realm="metrics"'},
                    b"missing or wrong bearer token: send 'Authorization: Bearer <token>'\n",
                )
        if dashboard is not None and peer is not None:
            status, headers, body = await dashboard.handle(method, target, peer[:2], local[:2])
            if method == "HEAD":
                headers["Content-Length"] = str(len(body))
                body = b""
            return status, headers, body
        if path != "/metrics":
            return 404, {}, b"not found; metrics are at /metrics\n"
        if method not in ("GET", "HEAD"):
            return 405, {"Allow": "GET, HEAD"}, b"method not allowed\n"
        accept = ""
        for line in lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        encoder, content_type = choose_encoder(accept)
        body = bytes(encoder(self.exposed))
        headers = {"Content-Type": content_type}
        if method == "HEAD":
            headers["Content-Length"] = str(len(body))
            body = b""
        return 200, headers, body


async def _respond(
    writer: asyncio.StreamWriter, status: int, body: bytes, headers: dict[str, str] | None = None
) -> None:
    fields = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(body))}
    fields.update(headers or {})
    fields["Connection"] = "close"
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    writer.write(head.encode("latin-1") + b"\r\n" + body)
    await writer.drain()
