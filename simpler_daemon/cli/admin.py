"""simplerctl daemon, callable and buffer commands: ``info``, ``workers``, ``callables``,
``register``, ``unregister``, ``buffers``, ``free``, ``drain``, ``resume``, ``add-remote``."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import grpc

from simpler_daemon.cli.output import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    CliExit,
    Out,
    human_bytes,
    remote_header,
    remote_row,
    short_name,
    to_dict,
    worker_header,
    worker_rows,
)
from simpler_daemon.client import Client
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = [
    "cmd_add_remote",
    "cmd_buffers",
    "cmd_callables",
    "cmd_discovery",
    "cmd_drain",
    "cmd_free",
    "cmd_info",
    "cmd_register",
    "cmd_resume",
    "cmd_unregister",
    "cmd_workers",
    "heap_line",
]


def heap_line(heap: pb.HeapInfo) -> str:
    """``12.0 MiB used of 256.0 MiB (4.7 %), 244.0 MiB free`` (+ the heap's name)."""
    size, used = int(heap.size_bytes), int(heap.used_bytes)
    share = f" ({100 * used / size:.1f} %)" if size else ""
    name = f" [{heap.name}]" if heap.name else ""
    return (
        f"{human_bytes(used)} used of {human_bytes(size)}{share}, "
        f"{human_bytes(max(size - used, 0))} free{name}"
    )


def cmd_info(c: Client, a: argparse.Namespace, out: Out) -> int:
    info = c.get_info()
    buffers = c.list_buffers().buffers
    if out.json:
        out.data({**to_dict(info), "buffers": {"count": len(buffers)}})
        return EXIT_OK
    lim = info.limits
    out.line(
        f"simpler-daemon {info.version} (level {info.level}) on {info.hostname}, pid {info.pid}"
    )
    out.line(
        f"state:    {short_name(pb.ServingState.Name(info.serving_state))}, "
        f"{info.active_runs} active runs"
        + (f", admission {lim.admission}" if lim.admission else "")
    )
    if info.serving_reason:
        out.line(f"health:   {info.serving_reason}")
    out.line(f"workers:  {info.num_sub_workers} SUB, {info.num_next_level_workers} NEXT_LEVEL")
    out.line(f"heap:     {heap_line(info.heap)}; {len(buffers)} buffers you can see")
    out.line(
        f"limits:   {lim.max_tasks_per_run} tasks/run, {lim.max_tensors_per_task} tensors "
        f"and {lim.max_scalars_per_task} scalars/task, "
        f"{human_bytes(lim.max_message_bytes)}/message, "
        f"{human_bytes(lim.max_buffer_bytes)}/buffer, {lim.max_concurrent_runs} concurrent runs"
    )
    if lim.max_value_bytes or lim.max_result_bytes:  # an older daemon sends neither
        out.line(
            f"values:   {human_bytes(lim.max_value_bytes)} of values and kwargs/task, "
            f"{human_bytes(lim.max_result_bytes)}/result"
        )
    out.line(
        f"quotas:   {lim.per_client_runs} runs, {human_bytes(lim.per_client_heap_bytes)} heap, "
        f"{lim.per_client_registrations} registrations, {lim.max_streams_per_client} streams "
        "per client"
    )
    out.line(f"caller:   {info.caller}" + (" (admin)" if info.caller_is_admin else ""))
    return EXIT_OK


def cmd_workers(c: Client, a: argparse.Namespace, out: Out) -> int:
    workers = c.list_workers()
    if out.json:
        out.data([to_dict(w) for w in workers])
        return EXIT_OK
    out.table(worker_header(), worker_rows(workers))
    remotes = [w for w in workers if w.HasField("remote")]
    if remotes:
        out.line("")
        out.table(remote_header(), [remote_row(w) for w in remotes])
    view = c.discovery()
    if view.dns:
        out.line("")
        discovery_lines(view, out)
    return EXIT_OK


def cmd_discovery(c: Client, a: argparse.Namespace, out: Out) -> int:
    view = c.discovery()
    if out.json:
        out.data(to_dict(view))
        return EXIT_OK
    if not view.dns:
        out.line("discovery is off ([workers.discovery] dns is not set)")
        return EXIT_OK
    discovery_lines(view, out)
    return EXIT_OK


def discovery_lines(view: pb.DiscoveryInfo, out: Out) -> None:
    """The ``discovery:`` block of ``simplerctl workers`` and ``simplerctl discovery``."""
    now = time.time()

    def when(t: float) -> str:
        return "never" if not t else f"{now - t:.1f} s ago"

    out.line(f"discovery: {view.dns} via {view.resolver}, every {view.refresh_seconds:g} s")
    out.line(
        f"  last resolution {when(view.last_resolve_unix)}, last answer "
        f"{when(view.last_success_unix)}; {view.resolutions} resolutions, "
        f"{view.failures} failed"
    )
    if view.error:
        out.line(f"  error: {view.error}")
    out.table(
        ["ADDRESS", "WORKER", "STATE", "MESSAGE"],
        [[d.address, d.worker_id, d.state, d.message] for d in view.addresses],
    )


def cmd_callables(c: Client, a: argparse.Namespace, out: Out) -> int:
    callables = c.list_callables()
    if out.json:
        out.data([to_dict(x) for x in callables])
        return EXIT_OK
    out.table(
        ["HASHID", "KIND", "REFS", "IMPORT PATH"],
        [
            [x.hashid, short_name(pb.CallableKind.Name(x.kind)), x.refcount, x.import_path]
            for x in callables
        ],
    )
    return EXIT_OK


def cmd_register(c: Client, a: argparse.Namespace, out: Out) -> int:
    # --reload re-imports the module in every child: same hashid, new code. Held until
    # unregistered: a registration of simplerctl's own session would end as it exits.
    response = c.register_callable(a.path, a.kind, reload=a.reload, persist=not a.reload)
    hashid, refcount = response.hashid, response.refcount
    if out.json:
        out.data(
            {
                "import_path": a.path,
                "kind": a.kind,
                "hashid": hashid,
                "refcount": refcount,
                "reloaded": bool(a.reload),
            }
        )
    else:
        how = ", reloaded" if a.reload else ""
        out.line(f"{hashid} {a.path} ({a.kind}, refcount {refcount}{how})")
    return EXIT_OK


def _hashid_of(c: Client, target: str) -> str:
    """A hashid as given; an import path: the hashid it is registered under."""
    if target.startswith("sha256:"):
        return target
    found = [x.hashid for x in c.list_callables() if x.import_path == target]
    if not found:
        raise LookupError(f"cannot unregister {target}: no callable registered by that path")
    if len(found) > 1:
        raise LookupError(
            f"cannot unregister {target}: registered as {len(found)} kinds; give the hashid "
            f"({', '.join(found)})"
        )
    return found[0]


def cmd_unregister(c: Client, a: argparse.Namespace, out: Out) -> int:
    try:
        hashid = _hashid_of(c, a.target)
    except LookupError as exc:
        out.error("NOT_FOUND", str(exc))
        raise CliExit(EXIT_NOT_FOUND) from None
    left = c.unregister(hashid)
    if out.json:
        out.data({"hashid": hashid, "refcount": left})
    elif left:
        out.line(f"{hashid}: one reference dropped, {left} left")
    else:
        out.line(f"{hashid}: unregistered")
    return EXIT_OK


def cmd_buffers(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.list_buffers()
    if out.json:
        out.data(to_dict(response))
        return EXIT_OK
    out.table(
        ["ID", "GEN", "DTYPE", "SHAPE", "SIZE", "REFS", "LABEL"],
        [
            [
                b.buffer_id,
                b.generation,
                b.dtype,
                "x".join(map(str, b.shape)) or "()",
                human_bytes(b.nbytes),
                b.references,
                b.label,
            ]
            for b in response.buffers
        ],
    )
    out.line(f"heap: {heap_line(response.heap)}")
    return EXIT_OK


def cmd_free(c: Client, a: argparse.Namespace, out: Out) -> int:
    results: list[dict[str, Any]] = []
    failed = EXIT_OK
    for buffer_id in a.buffers:
        try:
            deferred = c.free_buffer(buffer_id)
        except grpc.RpcError as exc:
            code, message = exc.code().name, exc.details() or exc.code().name
            # One JSON document for the command: each buffer's error in its own entry.
            out.error(code, message, document=False)
            results.append({"buffer_id": buffer_id, "error": {"code": code, "message": message}})
            failed = EXIT_NOT_FOUND if exc.code() == grpc.StatusCode.NOT_FOUND else EXIT_FAILED
            continue
        results.append({"buffer_id": buffer_id, "deferred": deferred})
        if not out.json:
            later = " (released when the runs using it end)" if deferred else ""
            out.line(f"buffer {buffer_id} freed{later}")
    if out.json:
        out.data(results)
    return failed


def cmd_drain(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.drain(a.grace, a.shutdown)
    if out.json:
        out.data(to_dict(response))
    else:
        out.line(
            f"drained: {response.runs_finished} runs finished, {response.runs_cancelled} cancelled"
            + ("" if a.shutdown else "; `simplerctl resume` admits runs again")
        )
    return EXIT_OK


def cmd_resume(c: Client, a: argparse.Namespace, out: Out) -> int:
    resumed = c.resume()
    if out.json:
        out.data({"resumed": resumed})
    else:
        out.line("serving again" if resumed else "was not draining: nothing to resume")
    return EXIT_OK


def cmd_add_remote(c: Client, a: argparse.Namespace, out: Out) -> int:
    options: dict[str, Any] = {}
    if a.session_timeout is not None:
        options["session_timeout_s"] = a.session_timeout
    for option, field in (
        ("heap_bytes", "heap_bytes"),
        ("chip_pipeline_depth", "chip_pipeline_depth"),
    ):
        if getattr(a, option) is not None:
            options[field] = getattr(a, option)
    for option, field in (
        ("worker_token_file", "token_file"),
        ("worker_tls_ca", "tls_ca_file"),
        ("worker_tls_cert", "tls_cert_file"),
        ("worker_tls_key", "tls_key_file"),
    ):
        if getattr(a, option):
            # The daemon opens the file: a path relative to this shell means nothing there.
            options[field] = os.path.abspath(getattr(a, option))
    if a.worker_server_name:
        options["tls_server_name"] = a.worker_server_name
    worker_id = c.add_remote_worker(a.endpoint, a.num_sub_workers, a.num_chips, **options)
    if out.json:
        out.data({"worker_id": worker_id})
    else:
        out.line(f"remote worker {worker_id} added: {a.endpoint}")
    return EXIT_OK
