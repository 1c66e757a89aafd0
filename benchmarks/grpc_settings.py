"""gRPC settings for the unary path: which server, event-engine and channel settings make
one unary round trip cheapest on this machine (issue 25 item 4).

Two families of cells; every variant is measured once per round, the variants alternated,
over several rounds of one invocation::

    floor   client process --unix--> bare echo server process (bytes in, bytes out)
    daemon  client process --unix--> simpler-daemon serve (its relay, then grpc.aio)

* **floor**: a minimal echo server with no servicer, no interceptor, no serializer, and a
  client that imports nothing of ours (grpcio's defaults): ``grpc.aio`` on uvloop (as the
  daemon runs it), the sync ``grpc.server`` with a thread
  pool, and the sync server whose handler hands each call to an asyncio loop thread and
  waits for it (what the daemon's asyncio service would need under a sync server);
  then the event-engine settings, server and channel options and client call styles on it.
* **daemon**: a real ``simpler-daemon serve`` subprocess: ``GetInfo`` and W6's gRPC W1 (one
  empty SUB task per ``SubmitRun`` with ``wait_seconds``), through the product ``Client``
  unless the variant names another call style. Both import grpc through
  ``simpler_daemon.system.grpcsetup`` (iomgr poller); ``daemon/env-ee*`` set
  ``GRPC_EXPERIMENTS`` back to grpcio's default EventEngine on one side or both.

Each server and each client is its own process, started with the variant's environment
(``GRPC_POLL_STRATEGY`` and ``GRPC_EXPERIMENTS`` are read once, when grpc starts) and kept
for all rounds; the driver asks each client in turn for one round of ``n`` calls. Figures:
the median of the per-round medians, each round's ratio to its family's baseline
(``floor/aio`` and ``daemon/base``) measured in the same round, and the CPU time per call
of the server process (every thread of it; a daemon's SUB workers are not counted) and of
the client process, from ``/proc/<pid>/task/*/schedstat`` around each round: less
disturbed by a busy machine than the wall time.

``--old-tree PATH`` adds the variant ``daemon/old-tree``: the daemon and its client from
another checkout (``git worktree add``; build its extension in place first), for a
before/after of the product's own settings in one invocation.

::

    python -m benchmarks.grpc_settings [--smoke] [--rounds N] [--n N] [--only SUBSTR]
                                       [--old-tree PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT = 30.0
WARM_UP_CALLS = 50
EMPTY = "simpler_daemon.examples.tasks:empty"
ECHO_METHOD = "/bench.Echo/Echo"
NUM_SUB_WORKERS = 2
NO_EE = "-event_engine_client,-event_engine_listener"
#: The daemon's gRPC server options today (server/daemon.py), the floor servers' base.
SERVER_BASE: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
#: The product client's channel options (client/base.py), the floor clients' base.
CLIENT_BASE: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class Variant:
    """One cell: a server (kind, options, environment, code tree) and a client against it."""

    name: str
    family: str  # "floor" or "daemon"
    server: str = "aio"  # floor: aio | sync | bridge; daemon: serve
    server_options: tuple[tuple[str, Any], ...] = ()
    client_style: str = "blocking"  # blocking | with_call | future | aio | client | aio_client
    client_options: tuple[tuple[str, Any], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    env_side: str = "both"  # whose environment gets ``env``: both | server | client
    tree: str = ""  # "" = this checkout
    private: bool = False  # daemon: connect to the gRPC server's private socket (no relay)
    note: str = ""

    def server_key(self) -> tuple[Any, ...]:
        return (self.family, self.server, self.server_options, self.server_env(), self.tree)

    def server_env(self) -> tuple[tuple[str, str], ...]:
        return self.env if self.env_side in ("both", "server") else ()

    def client_env(self) -> tuple[tuple[str, str], ...]:
        return self.env if self.env_side in ("both", "client") else ()


def _variants(old_tree: str | None) -> list[Variant]:
    poll = (("GRPC_POLL_STRATEGY", "poll"),)
    no_ee = (("GRPC_EXPERIMENTS", NO_EE),)
    ee = (("GRPC_EXPERIMENTS", "event_engine_client,event_engine_listener"),)
    latency = (("grpc.optimization_target", "latency"),)
    no_bdp = (("grpc.http2.bdp_probe", 0),)
    no_channelz = (("grpc.enable_channelz", 0),)
    no_retries = (("grpc.enable_retries", 0),)
    streams = (("grpc.max_concurrent_streams", 1000),)
    write_buffer = (("grpc.http2.write_buffer_size", 0),)
    keepalive = (("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000))
    server_all = latency + no_bdp + no_channelz + streams
    client_all = no_retries + latency + no_bdp + no_channelz
    floor = [
        Variant("floor/aio", "floor", note="grpc.aio server on uvloop, sync blocking stub"),
        Variant("floor/sync", "floor", server="sync", note="grpc.server, 4-thread pool"),
        Variant("floor/bridge", "floor", server="bridge", note="sync server -> asyncio thread"),
        Variant("floor/client-aio", "floor", client_style="aio", note="grpc.aio client"),
        Variant("floor/with_call", "floor", client_style="with_call"),
        Variant("floor/future", "floor", client_style="future", note="future().result()"),
        Variant("floor/env-poll", "floor", env=poll, note="GRPC_POLL_STRATEGY=poll"),
        Variant("floor/env-no-ee", "floor", env=no_ee, note="EventEngine client+listener off"),
        Variant("floor/env-no-ee-server", "floor", env=no_ee, env_side="server"),
        Variant("floor/env-no-ee-client", "floor", env=no_ee, env_side="client"),
        Variant(
            "floor/env-no-ee-client-exp",
            "floor",
            env=(("GRPC_EXPERIMENTS", "-event_engine_client"),),
            note="only event_engine_client off",
        ),
        Variant(
            "floor/env-no-ee-listener-exp",
            "floor",
            env=(("GRPC_EXPERIMENTS", "-event_engine_listener"),),
            note="only event_engine_listener off",
        ),
        Variant("floor/no-ee+poll", "floor", env=no_ee + poll),
        Variant("floor/sync+no-ee", "floor", server="sync", env=no_ee),
        Variant("floor/client-aio+no-ee", "floor", client_style="aio", env=no_ee),
        Variant("floor/bridge+no-ee", "floor", server="bridge", env=no_ee),
        Variant("floor/future+no-ee", "floor", client_style="future", env=no_ee),
        Variant(
            "floor/env-cq",
            "floor",
            env=(("GRPC_EXPERIMENTS", "event_engine_callback_cq"),),
            note="event_engine_callback_cq on",
        ),
        Variant(
            "floor/env-pollset-alt",
            "floor",
            env=(("GRPC_EXPERIMENTS", "pollset_alternative"),),
            note="pollset_alternative on",
        ),
        Variant("floor/srv-latency", "floor", server_options=latency),
        Variant("floor/srv-no-bdp", "floor", server_options=no_bdp),
        Variant("floor/srv-no-channelz", "floor", server_options=no_channelz),
        Variant("floor/srv-write-buffer-0", "floor", server_options=write_buffer),
        Variant("floor/srv-all", "floor", server_options=server_all + keepalive),
        Variant("floor/cli-no-retries", "floor", client_options=no_retries),
        Variant("floor/cli-latency", "floor", client_options=latency),
        Variant("floor/cli-no-channelz", "floor", client_options=no_channelz),
        Variant("floor/cli-no-bdp", "floor", client_options=no_bdp),
        Variant("floor/cli-all", "floor", client_options=client_all),
        Variant("floor/all", "floor", server_options=server_all, client_options=client_all),
        Variant(
            "floor/all+no-ee",
            "floor",
            server_options=server_all,
            client_options=client_all,
            env=no_ee,
        ),
    ]
    daemon = [
        Variant("daemon/base", "daemon", "serve", client_style="client", note="product Client"),
        Variant("daemon/env-poll", "daemon", "serve", client_style="client", env=poll),
        Variant(
            "daemon/env-ee",
            "daemon",
            "serve",
            client_style="client",
            env=ee,
            note="GRPC_EXPERIMENTS keeps the EventEngine (grpcio's default)",
        ),
        Variant(
            "daemon/env-ee-server",
            "daemon",
            "serve",
            client_style="client",
            env=ee,
            env_side="server",
        ),
        Variant(
            "daemon/env-ee-client",
            "daemon",
            "serve",
            client_style="client",
            env=ee,
            env_side="client",
        ),
        Variant(
            "daemon/cli-all",
            "daemon",
            "serve",
            client_style="client",
            client_options=client_all,
            note="product Client, extra channel options",
        ),
        Variant("daemon/stub", "daemon", "serve", note="raw stub, same request"),
        Variant("daemon/future", "daemon", "serve", client_style="future"),
        Variant("daemon/aio-client", "daemon", "serve", client_style="aio_client"),
        Variant(
            "daemon/private",
            "daemon",
            "serve",
            private=True,
            note="raw stub on the private socket: no relay hop",
        ),
    ]
    if old_tree:
        daemon.append(
            Variant(
                "daemon/old-tree",
                "daemon",
                "serve",
                client_style="client",
                tree=os.path.abspath(old_tree),
                note=f"daemon and client from {old_tree}",
            )
        )
    return floor + daemon


# ----------------------------------------------------------------------- child processes


def _env(variant_env: tuple[tuple[str, str], ...], tree: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    env.update(variant_env)
    env["PYTHONPATH"] = tree or str(REPO_ROOT)
    return env


def _echo_server(spec: dict[str, Any]) -> None:
    """Serve the echo method on ``spec["socket"]`` until stdin closes."""
    import grpc

    options = [tuple(o) for o in spec["options"]]
    kind = spec["kind"]

    def ready() -> None:
        sys.stdout.write("READY\n")
        sys.stdout.flush()

    if kind == "aio":
        import uvloop

        async def echo_async(request: bytes, context: Any) -> bytes:
            return request

        async def serve() -> None:
            server = grpc.aio.server(options=options)
            handler = grpc.unary_unary_rpc_method_handler(echo_async)
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
            )
            server.add_insecure_port("unix:" + spec["socket"])
            await server.start()
            ready()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, sys.stdin.read)
            await server.stop(None)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
        return

    loop: asyncio.AbstractEventLoop | None = None
    if kind == "bridge":
        import uvloop

        loop = uvloop.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

    async def on_loop(request: bytes) -> bytes:
        return request

    def echo(request: bytes, context: Any) -> bytes:
        if loop is None:
            return request
        return asyncio.run_coroutine_threadsafe(on_loop(request), loop).result()

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=options)
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    server.add_insecure_port("unix:" + spec["socket"])
    server.start()
    ready()
    sys.stdin.read()
    server.stop(None)


def _client(spec: dict[str, Any]) -> None:
    """Answer each ``n`` read from stdin with one JSON line: ``{call: [ns, ...]}``."""
    import grpc

    style = spec["style"]
    options = CLIENT_BASE + [tuple(o) for o in spec["options"]]
    clock = time.perf_counter_ns
    calls: dict[str, Any] = {}
    loop: asyncio.AbstractEventLoop | None = None
    closers: list[Any] = []

    def sync_call(method: Any, request: Any, **kw: Any) -> Any:
        if style == "with_call":
            return lambda: method.with_call(request, **kw)
        if style == "future":
            return lambda: method.future(request, **kw).result()
        return lambda: method(request, **kw)

    if spec["family"] == "floor":
        payload = b"x" * 16
        if style == "aio":
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)  # the channel binds to the loop it is made on
            channel = grpc.aio.insecure_channel(spec["target"], options)
            method = channel.unary_unary(ECHO_METHOD)
            calls["echo"] = lambda: method(payload)
        else:
            channel = grpc.insecure_channel(spec["target"], options)
            closers.append(channel)
            calls["echo"] = sync_call(channel.unary_unary(ECHO_METHOD), payload)
    else:
        from simpler_daemon.client import AsyncClient, Client, sub_task
        from simpler_daemon.client.requests import submit_request
        from simpler_daemon.client.retry import new_key
        from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
        from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2_grpc as pb_grpc

        extra = [tuple(o) for o in spec["options"]]

        class TunedClient(Client):
            def _new_channel(self) -> Any:
                self.options = self.options + extra
                return super()._new_channel()

        class TunedAsyncClient(AsyncClient):
            def _new_channel(self) -> Any:
                self.options = self.options + extra
                return super()._new_channel()

        sock = spec["socket"]
        product = TunedClient(sock, timeout=None, transport="grpc")
        closers.append(product)
        tasks = [sub_task(product.register(EMPTY))]

        def check(response: Any) -> None:
            if response.status.state != pb.RUN_STATE_COMPLETED:
                raise RuntimeError(f"cannot measure W1: run {response.status.run_id} failed")

        if style == "client":
            calls["info"] = product.get_info
            calls["w1"] = lambda: check(product.submit_run(tasks, wait_seconds=600.0))
        elif style == "aio_client":
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            aclient = TunedAsyncClient(sock, timeout=None, transport="grpc")

            async def aw1() -> None:
                check(await aclient.submit_run(tasks, wait_seconds=600.0))

            calls["info"] = aclient.get_info
            calls["w1"] = aw1
        else:
            target = "unix:" + (spec["private_socket"] if spec["private"] else sock)
            channel = grpc.insecure_channel(target, options)
            closers.append(channel)
            stub = pb_grpc.DaemonStub(channel)
            md = product.metadata
            info = sync_call(stub.GetInfo, pb.GetInfoRequest(), metadata=md)
            calls["info"] = info
            submit = stub.SubmitRun

            def w1() -> None:
                request = submit_request(tasks, new_key(), "", 600.0)
                call = sync_call(submit, request, metadata=md, timeout=630.0)
                response = call()
                check(response[0] if style == "with_call" else response)

            calls["w1"] = w1

    async def round_async(fn: Any, n: int) -> list[int]:
        samples = []
        for _ in range(n):
            t0 = clock()
            await fn()
            samples.append(clock() - t0)
        return samples

    def round_sync(fn: Any, n: int) -> list[int]:
        samples = []
        for _ in range(n):
            t0 = clock()
            fn()
            samples.append(clock() - t0)
        return samples

    def one_round(call: str, n: int) -> list[int]:
        if loop is not None:
            return loop.run_until_complete(round_async(calls[call], n))
        return round_sync(calls[call], n)

    for call in calls:
        one_round(call, WARM_UP_CALLS)
    sys.stdout.write("READY " + ",".join(calls) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        call, n = line.split()
        sys.stdout.write(json.dumps(one_round(call, int(n))) + "\n")
        sys.stdout.flush()
    for closer in closers:
        closer.close()


# ---------------------------------------------------------------------------- the driver


def _wait_ready(proc: subprocess.Popen[str], what: str) -> list[str]:
    """Wait for the child's ``READY [call,...]`` line: its call names."""
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    if words[:1] != ["READY"]:
        proc.wait(STOP_TIMEOUT)
        raise RuntimeError(f"{what} did not start (exit {proc.returncode}); see its stderr above")
    return words[1].split(",") if len(words) > 1 else []


def _cpu_ns(pid: int) -> int:
    """CPU time so far of every live thread of ``pid`` (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
    return total


def _spawn(mode: str, spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-P", __file__, mode, json.dumps(spec)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _daemon_config(directory: Path) -> str:
    return f"""\
[daemon]
runtime_dir = "{directory / "run"}"
state_dir = "{directory / "state"}"
shutdown_grace = 5.0
log_level = "warning"
watchdog = false

[workers]
num_sub_workers = {NUM_SUB_WORKERS}
num_chips = 0
heap_bytes = 16777216
"""


@contextlib.contextmanager
def _daemon(directory: Path, env: dict[str, str]) -> Iterator[tuple[str, str, int]]:
    """A ``simpler-daemon serve`` subprocess; yields its (public, private) socket paths
    and its pid."""
    from benchmarks.w6 import serve

    directory.mkdir()
    with serve(directory, _daemon_config(directory), env, "grpc_settings") as pid:
        run = directory / "run"
        private = [p for p in run.iterdir() if p.is_socket() and "priv" in p.name]
        yield str(run / "daemon.sock"), str(private[0]) if private else "", pid


@dataclass
class _Cell:
    variant: Variant
    client: subprocess.Popen[str]
    server_pid: int
    calls: list[str]
    rounds: list[dict[str, dict[str, float]]] = field(default_factory=list)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _figures(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000.0 for s in samples_ns)
    return {
        "median_us": statistics.median(us),
        "p90_us": us[min(len(us) - 1, int(len(us) * 0.9))],
        "min_us": us[0],
    }


def measure(variants: list[Variant], rounds: int, n: int) -> dict[str, Any]:
    """Run every variant ``rounds`` times, alternated; the per-round figures per call."""
    cells: list[_Cell] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-grpcset-")))
        servers: dict[tuple[Any, ...], dict[str, Any]] = {}
        for i, v in enumerate(variants):
            key = v.server_key()
            if key in servers:
                continue
            env = _env(v.server_env(), v.tree)
            if v.family == "daemon":
                public, private, pid = stack.enter_context(_daemon(tmp / f"d{i}", env))
                servers[key] = {"socket": public, "private_socket": private, "pid": pid}
                continue
            path = str(tmp / f"echo{i}.sock")
            spec = {
                "kind": v.server,
                "socket": path,
                "options": SERVER_BASE + list(v.server_options),
            }
            proc = _spawn("--serve-echo", spec, env)
            stack.callback(_stop, proc)
            _wait_ready(proc, f"echo server for {v.name}")
            servers[key] = {"socket": path, "private_socket": "", "pid": proc.pid}
        for v in variants:
            where = servers[v.server_key()]
            if v.private and not where["private_socket"]:
                print(
                    f"grpc_settings: {v.name}: no private socket found, left out", file=sys.stderr
                )
                continue
            spec = {
                "family": v.family,
                "style": v.client_style,
                "options": list(v.client_options),
                "target": "unix:" + where["socket"],
                "private": v.private,
                **where,
            }
            client = _spawn("--client", spec, _env(v.client_env(), v.tree))
            stack.callback(_stop, client)
            calls = _wait_ready(client, f"client of {v.name}")
            cells.append(_Cell(v, client, where["pid"], calls))
        for r in range(rounds):
            order = cells if r % 2 == 0 else cells[::-1]
            for cell in order:
                cell.rounds.append({call: _one_round(cell, call, n) for call in cell.calls})
    return _summary(cells)


def _one_round(cell: _Cell, call: str, n: int) -> dict[str, float]:
    """``n`` calls of ``call`` by the cell's client: their figures, with the CPU the
    server process (all its threads; not a daemon's workers) and the client spent."""
    client = cell.client
    assert client.stdin is not None and client.stdout is not None
    server0, client0 = _cpu_ns(cell.server_pid), _cpu_ns(client.pid)
    client.stdin.write(f"{call} {n}\n")
    client.stdin.flush()
    line = client.stdout.readline()
    server1, client1 = _cpu_ns(cell.server_pid), _cpu_ns(client.pid)
    if not line:
        raise RuntimeError(f"the client of {cell.variant.name} exited mid-round")
    figures = _figures(json.loads(line))
    figures["server_cpu_us"] = (server1 - server0) / n / 1000.0
    figures["client_cpu_us"] = (client1 - client0) / n / 1000.0
    return figures


def _summary(cells: list[_Cell]) -> dict[str, Any]:
    base = {c.variant.family: c for c in cells if c.variant.name in ("floor/aio", "daemon/base")}
    out: dict[str, Any] = {}
    for cell in cells:
        v = cell.variant
        entry: dict[str, Any] = {
            "family": v.family,
            "server": v.server,
            "server_options": dict(v.server_options),
            "client_style": v.client_style,
            "client_options": dict(v.client_options),
            "env": dict(v.env),
            "env_side": v.env_side,
            "tree": v.tree or str(REPO_ROOT),
            "private_socket": v.private,
            "note": v.note,
            "calls": {},
        }
        ref = base.get(v.family)
        for call in cell.rounds[0]:
            medians = [rnd[call]["median_us"] for rnd in cell.rounds]
            figures: dict[str, Any] = {
                "median_us": statistics.median(medians),
                "p90_us": statistics.median(rnd[call]["p90_us"] for rnd in cell.rounds),
                "server_cpu_us": statistics.median(
                    rnd[call]["server_cpu_us"] for rnd in cell.rounds
                ),
                "client_cpu_us": statistics.median(
                    rnd[call]["client_cpu_us"] for rnd in cell.rounds
                ),
                "round_medians_us": [round(m, 1) for m in medians],
            }
            if ref is not None and call in ref.rounds[0]:
                ratios = [
                    m / rr[call]["median_us"] for m, rr in zip(medians, ref.rounds, strict=True)
                ]
                figures["ratio_median"] = statistics.median(ratios)
                figures["ratios"] = [round(x, 3) for x in ratios]
            entry["calls"][call] = figures
        out[v.name] = entry
    return out


def _table(summary: dict[str, Any]) -> str:
    lines = [
        "| variant | call | median µs | p90 µs | x baseline (median, range) "
        "| server CPU µs/call | client CPU µs/call | note |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for name, entry in summary.items():
        for call, f in entry["calls"].items():
            ratio = (
                f"{f['ratio_median']:.2f} ({min(f['ratios']):.2f}-{max(f['ratios']):.2f})"
                if "ratios" in f
                else ""
            )
            lines.append(
                f"| {name} | {call} | {f['median_us']:.0f} | {f['p90_us']:.0f} | {ratio} "
                f"| {f['server_cpu_us']:.0f} | {f['client_cpu_us']:.0f} | {entry['note']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-echo"]:
        _echo_server(json.loads(argv[1]))
        return 0
    if argv[:1] == ["--client"]:
        _client(json.loads(argv[1]))
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_settings", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--smoke", action="store_true", help="2 rounds of 20 calls per variant")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=300, help="calls per variant and round")
    ap.add_argument("--only", action="append", default=[], help="variants whose name has this")
    ap.add_argument("--old-tree", help="another checkout: adds daemon/old-tree")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    rounds, n = (2, 20) if args.smoke else (args.rounds, args.n)
    variants = _variants(args.old_tree)
    if args.only:
        keep = {"floor/aio", "daemon/base"}
        variants = [v for v in variants if v.name in keep or any(s in v.name for s in args.only)]
    started = time.time()
    summary = measure(variants, rounds, n)
    result = {
        "benchmark": "grpc_settings",
        "rounds": rounds,
        "n": n,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "variants": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print()
    print(_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
