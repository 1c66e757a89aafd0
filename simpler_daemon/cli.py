"""``simplerctl``: the command-line client of simpler-daemon.

::

    simplerctl [--socket PATH|HOST:PORT] [--json] COMMAND ...
      info                      daemon version, level, heap, limits, serving state
      workers                   every worker and its state
      callables                 every registered callable
      register PATH [--kind]    register "module:qualname" (kind sub, chip or orchestration)
      submit FILE [--wait|--watch] [--timeout S] [--idempotency-key K] [--label L]
      watch RUN                 live progress until the run ends
      wait RUN [--timeout S]    wait for a run; its status
      cancel RUN [--reason R]   cancel a run
      buffers                   every live buffer
      drain [--grace S] [--shutdown]

A run spec (JSON, or TOML when the file ends in ``.toml``)::

    label = "demo"
    [buffers.a]                       # optional: buffers created (and filled) for the run
    shape = [8]
    dtype = "float32"
    fill = 2                          # or data = [...]
    [buffers.out]
    shape = [8]
    dtype = "float32"

    [[tasks]]
    kind = "sub"                      # sub | sub_group | next_level | next_level_group
    callable = "simpler_daemon.examples.tasks:scale"   # import path (registered first) or hashid
    scalars = [3]                     # one member: tensors/scalars inline, else [[tasks.members]]
    tensors = [{ buffer = "a", tag = "inout" }]         # buffer: a name above or a buffer id;
                                                        # shape/dtype default to the buffer's
    workers = []                      # NEXT_LEVEL targets
    config = { deadline_ms = 1000 }

Exit status: 0 ok, 1 the run failed (or was cancelled), 2 usage or validation
error (a bad spec, an INVALID_ARGUMENT, PERMISSION_DENIED, RESOURCE_EXHAUSTED or
FAILED_PRECONDITION from the daemon), 3 daemon unreachable, 4 not found,
5 ``wait``/``--wait`` timed out with the run still active.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NoReturn, TextIO

import grpc
import numpy as np

from simpler_daemon import __version__
from simpler_daemon.client import TERMINAL_STATES, Client, call_config, make_args, task, tensor
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["EXIT_FAILED", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "main"]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_NOT_FOUND: Final = 4
EXIT_TIMEOUT: Final = 5

_STATUS_EXIT: Final[dict[grpc.StatusCode, int]] = {
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_UNREACHABLE,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_USAGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_USAGE,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_USAGE,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_USAGE,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE,
    grpc.StatusCode.UNIMPLEMENTED: EXIT_USAGE,
}
_SUB_KINDS: Final = ("sub", "sub_group")
_TASK_KINDS: Final = ("sub", "sub_group", "next_level", "next_level_group")
_MAX_SHOWN: Final = 64


class SpecError(ValueError):
    """A run spec that cannot be turned into a SubmitRun; names the key."""


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# --------------------------------------------------------------------------- output


def to_dict(msg: Any) -> dict[str, Any]:
    """A message as plain JSON data: enum names, ints as numbers, RFC 3339 timestamps."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        name = field.name
        if field.has_presence and not msg.HasField(name):
            continue
        value = getattr(msg, name)
        if field.is_repeated:
            out[name] = [_value(field, v) for v in value]
        else:
            out[name] = _value(field, value)
    return out


def _value(field: Any, value: Any) -> Any:
    if field.type == field.TYPE_MESSAGE:
        if field.message_type.full_name == "google.protobuf.Timestamp":
            return value.ToJsonString() if (value.seconds or value.nanos) else None
        return to_dict(value)
    if field.type == field.TYPE_ENUM:
        ev = field.enum_type.values_by_number.get(value)
        return ev.name if ev is not None else value
    if field.type == field.TYPE_BYTES:
        return value.hex()
    return value


def _short(enum_name: str) -> str:
    for prefix in (
        "RUN_STATE_",
        "RUN_EVENT_TYPE_",
        "WORKER_KIND_",
        "WORKER_STATE_",
        "SERVING_STATE_",
        "CALLABLE_KIND_",
    ):
        if enum_name.startswith(prefix):
            return enum_name[len(prefix) :]
    return enum_name


class Out:
    """Human text or JSON on stdout; errors on stderr."""

    def __init__(self, as_json: bool, stream: TextIO | None = None) -> None:
        self.json = as_json
        self.stream = stream or sys.stdout

    def data(self, obj: Any) -> None:
        print(json.dumps(obj, indent=None if isinstance(obj, list) else 2), file=self.stream)

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for r in cells:
            self.line("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())

    def error(self, code: str, message: str) -> None:
        if self.json:
            print(json.dumps({"error": {"code": code, "message": message}}), file=self.stream)
        print(
            f"simplerctl: {code}: {message}" if code else f"simplerctl: {message}",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------- run specs


def load_spec(path: str) -> dict[str, Any]:
    """Read a run spec (TOML when the name ends in .toml, else JSON; ``-`` = stdin JSON)."""
    try:
        if path == "-":
            data: Any = json.load(sys.stdin)
        elif path.endswith(".toml"):
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        else:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the run spec must be a table/object with 'tasks'")
    return data


def _get(
    d: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = None
) -> Any:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise SpecError(f"{where}.{key}: expected {names}, got {type(value).__name__}")
    return value


def _ints(d: Mapping[str, Any], key: str, where: str) -> list[int]:
    values = _get(d, key, where, list, [])
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(f"{where}.{key}[{i}]: expected an integer, got {v!r}")
    return list(values)


class SpecBuilder:
    """Turns a run spec into Tasks: creates its buffers, registers import paths."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.created: dict[str, tuple[int, tuple[int, ...], str]] = {}
        self._hashids: dict[tuple[str, str], str] = {}
        self._buffers: dict[int, pb.BufferInfo] | None = None

    def buffers(self, spec: Mapping[str, Any]) -> None:
        table = _get(spec, "buffers", "spec", dict, {})
        for name, b in table.items():
            where = f"buffers.{name}"
            if not isinstance(b, dict):
                raise SpecError(f"{where}: expected a table with shape and dtype")
            shape = tuple(_ints(b, "shape", where))
            dtype = _get(b, "dtype", where, str, "float32")
            try:
                dt = np.dtype(dtype)
            except TypeError as exc:
                raise SpecError(f"{where}.dtype: unknown dtype {dtype!r}") from exc
            arr = np.zeros(shape, dtype=dt)
            if "data" in b:
                try:
                    arr[...] = np.asarray(b["data"], dtype=dt).reshape(shape)
                except (ValueError, TypeError) as exc:
                    raise SpecError(f"{where}.data: {exc}") from exc
            elif "fill" in b:
                arr[...] = b["fill"]
            buffer_id = self.client.alloc_array(arr, label=name)
            self.created[name] = (buffer_id, shape, dt.name)

    def _buffer_info(self, buffer_id: int, where: str) -> pb.BufferInfo:
        if self._buffers is None:
            self._buffers = {b.buffer_id: b for b in self.client.list_buffers().buffers}
        info = self._buffers.get(buffer_id)
        if info is None:
            raise SpecError(f"{where}.buffer: buffer {buffer_id} does not exist")
        return info

    def _tensor(self, t: Any, where: str) -> pb.TensorRef:
        if not isinstance(t, dict):
            raise SpecError(f"{where}: expected a table with buffer and tag")
        ref = t.get("buffer")
        if isinstance(ref, str):
            if ref not in self.created:
                raise SpecError(f"{where}.buffer: no buffer named {ref!r} in [buffers]")
            buffer_id, bshape, bdtype = self.created[ref]
        elif isinstance(ref, int) and not isinstance(ref, bool):
            info = self._buffer_info(ref, where) if ("shape" not in t or "dtype" not in t) else None
            buffer_id = ref
            bshape = tuple(info.shape) if info else ()
            bdtype = info.dtype if info else ""
        else:
            raise SpecError(f"{where}.buffer: expected a buffer name or id, got {ref!r}")
        offset = _get(t, "offset", where, int, 0)
        dtype = _get(t, "dtype", where, str, bdtype)
        shape: tuple[int, ...]
        if "shape" in t:
            shape = tuple(_ints(t, "shape", where))
        elif dtype == bdtype and offset == 0:
            shape = bshape
        else:
            itemsize = np.dtype(dtype).itemsize
            nbytes = math.prod(bshape) * np.dtype(bdtype).itemsize
            shape = ((nbytes - offset) // itemsize,)
        try:
            return tensor(
                buffer_id,
                _get(t, "tag", where, (str, int), "input"),
                shape,
                dtype,
                byte_offset=offset,
                strides=_ints(t, "strides", where) or None,
                generation=_get(t, "generation", where, int, 0),
            )
        except (ValueError, TypeError) as exc:
            raise SpecError(f"{where}: {exc}") from exc

    def _members(self, t: Mapping[str, Any], where: str) -> list[pb.Args]:
        members = t.get("members")
        if members is None:
            members = [{"tensors": t.get("tensors", []), "scalars": t.get("scalars", [])}]
        elif "tensors" in t or "scalars" in t:
            raise SpecError(f"{where}: give either members or tensors/scalars, not both")
        if not isinstance(members, list):
            raise SpecError(f"{where}.members: expected a list")
        out = []
        for m, member in enumerate(members):
            mw = f"{where}.members[{m}]"
            if not isinstance(member, dict):
                raise SpecError(f"{mw}: expected a table")
            tensors = _get(member, "tensors", mw, list, [])
            refs = [self._tensor(x, f"{mw}.tensors[{i}]") for i, x in enumerate(tensors)]
            out.append(make_args(refs, _ints(member, "scalars", mw)))
        return out

    def _hashid(self, target: str, kind: str, where: str) -> str:
        if target.startswith("sha256:"):
            return target
        callable_kind = "sub" if kind in _SUB_KINDS else "chip"
        key = (target, callable_kind)
        if key not in self._hashids:
            try:
                self._hashids[key] = self.client.register(target, callable_kind)
            except grpc.RpcError as exc:
                raise _RpcAt(f"{where}.callable", exc) from exc
        return self._hashids[key]

    def tasks(self, spec: Mapping[str, Any]) -> list[pb.Task]:
        tasks = spec.get("tasks")
        if not isinstance(tasks, list) or not tasks:
            raise SpecError("tasks: the run spec needs a non-empty list of tasks")
        out = []
        for i, t in enumerate(tasks):
            where = f"tasks[{i}]"
            if not isinstance(t, dict):
                raise SpecError(f"{where}: expected a table")
            kind = _get(t, "kind", where, str, "sub").lower()
            if kind not in _TASK_KINDS:
                raise SpecError(f"{where}.kind: {kind!r} is not one of {', '.join(_TASK_KINDS)}")
            target = _get(t, "callable", where, str, "")
            if not target:
                raise SpecError(f"{where}.callable: required (an import path or a hashid)")
            config = None
            if "config" in t:
                cfg = _get(t, "config", where, dict)
                try:
                    config = call_config(**cfg)
                except (TypeError, ValueError) as exc:
                    raise SpecError(f"{where}.config: {exc}") from exc
            members = self._members(t, where)
            hashid = self._hashid(target, kind, where)
            out.append(
                task(kind, hashid, members, workers=_ints(t, "workers", where), config=config)
            )
        return out


class _RpcAt(Exception):
    def __init__(self, where: str, exc: grpc.RpcError) -> None:
        super().__init__(where)
        self.where = where
        self.rpc = exc


# --------------------------------------------------------------------------- commands


def _state_name(state: int) -> str:
    return _short(pb.RunState.Name(state)) if state in pb.RunState.values() else str(state)


def _print_status(out: Out, status: pb.RunStatus) -> None:
    if out.json:
        out.data(to_dict(status))
        return
    c = status.counts
    out.line(
        f"run {status.run_id}: {_state_name(status.state)} "
        f"(done {c.done}/{c.total}, failed {c.failed}, running {c.running})"
    )
    if status.state in (pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED) and status.error.message:
        out.line(f"  error: {status.error.message}")


def _status_exit(status: pb.RunStatus) -> int:
    if status.state == pb.RUN_STATE_COMPLETED:
        return EXIT_OK
    if status.state in TERMINAL_STATES:
        return EXIT_FAILED
    return EXIT_TIMEOUT


def cmd_info(c: Client, a: argparse.Namespace, out: Out) -> int:
    info = c.get_info()
    if out.json:
        out.data(to_dict(info))
        return EXIT_OK
    lim = info.limits
    out.line(
        f"simpler-daemon {info.version} (level {info.level}) on {info.hostname}, pid {info.pid}"
    )
    out.line(
        f"state:    {_short(pb.ServingState.Name(info.serving_state))}, "
        f"{info.active_runs} active runs"
    )
    out.line(f"workers:  {info.num_sub_workers} SUB, {info.num_next_level_workers} NEXT_LEVEL")
    out.line(
        f"heap:     {info.heap.used_bytes}/{info.heap.size_bytes} bytes used"
        + (f" ({info.heap.name})" if info.heap.name else "")
    )
    out.line(
        f"limits:   {lim.max_tasks_per_run} tasks/run, {lim.max_tensors_per_task} tensors "
        f"and {lim.max_scalars_per_task} scalars/task, {lim.max_message_bytes} bytes/message, "
        f"{lim.max_buffer_bytes} bytes/buffer, {lim.max_concurrent_runs} concurrent runs"
    )
    return EXIT_OK


def cmd_workers(c: Client, a: argparse.Namespace, out: Out) -> int:
    workers = c.list_workers()
    if out.json:
        out.data([to_dict(w) for w in workers])
        return EXIT_OK
    out.table(
        ["ID", "KIND", "STATE", "PID", "TASKS", "RESTARTS", "MESSAGE"],
        [
            [
                w.worker_id,
                _short(pb.WorkerKind.Name(w.kind)),
                _short(pb.WorkerState.Name(w.state)),
                w.pid,
                w.tasks_completed,
                w.restarts,
                w.message or w.endpoint,
            ]
            for w in workers
        ],
    )
    return EXIT_OK


def cmd_callables(c: Client, a: argparse.Namespace, out: Out) -> int:
    callables = c.list_callables()
    if out.json:
        out.data([to_dict(x) for x in callables])
        return EXIT_OK
    out.table(
        ["HASHID", "KIND", "REFS", "IMPORT PATH"],
        [
            [x.hashid, _short(pb.CallableKind.Name(x.kind)), x.refcount, x.import_path]
            for x in callables
        ],
    )
    return EXIT_OK


def cmd_register(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.register_callable(a.path, a.kind)
    if out.json:
        out.data({"import_path": a.path, "kind": a.kind, **to_dict(response)})
    else:
        out.line(f"{response.hashid} {a.path} ({a.kind}, refcount {response.refcount})")
    return EXIT_OK


def cmd_buffers(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.list_buffers()
    if out.json:
        out.data(to_dict(response))
        return EXIT_OK
    out.table(
        ["ID", "GEN", "DTYPE", "SHAPE", "BYTES", "REFS", "LABEL"],
        [
            [
                b.buffer_id,
                b.generation,
                b.dtype,
                "x".join(map(str, b.shape)) or "()",
                b.nbytes,
                b.references,
                b.label,
            ]
            for b in response.buffers
        ],
    )
    h = response.heap
    out.line(f"heap: {h.used_bytes}/{h.size_bytes} bytes used")
    return EXIT_OK


def cmd_submit(c: Client, a: argparse.Namespace, out: Out) -> int:
    spec = load_spec(a.file)
    builder = SpecBuilder(c)
    label = a.label if a.label is not None else _get(spec, "label", "spec", str, "")
    key = (
        a.idempotency_key
        if a.idempotency_key is not None
        else _get(spec, "idempotency_key", "spec", str, "")
    )
    builder.buffers(spec)
    tasks = builder.tasks(spec)
    response = c.submit_run(tasks, idempotency_key=key, label=label)
    run_id = response.run_id
    buffers = {name: bid for name, (bid, _, _) in builder.created.items()}
    if not (a.wait or a.watch):
        if out.json:
            out.data({"run_id": run_id, "deduplicated": response.deduplicated, "buffers": buffers})
        else:
            dedup = " (deduplicated: an earlier run with this key)" if response.deduplicated else ""
            out.line(f"run {run_id} submitted{dedup}")
            for name, bid in buffers.items():
                out.line(f"  buffer {name}: {bid}")
        return EXIT_OK
    if a.watch:
        code = _watch(c, run_id, out, a.timeout)
        status = c.wait_run(run_id, 0)
    else:
        status = c.wait_run(run_id, a.timeout)
        code = _status_exit(status)
    contents = {}
    if status.state == pb.RUN_STATE_COMPLETED:
        for name, (bid, shape, dtype) in builder.created.items():
            if math.prod(shape) <= _MAX_SHOWN:
                contents[name] = c.read_array(bid, shape, dtype).tolist()
    if out.json:
        if a.wait:
            out.data({**to_dict(status), "buffers": buffers, "contents": contents})
    else:
        if a.wait:
            _print_status(out, status)
        for name, values in contents.items():
            out.line(f"  {name} (buffer {buffers[name]}): {values}")
    return code


def _progress(ev: pb.RunEvent, width: int = 30) -> str:
    c = ev.counts
    total = max(c.total, 1)
    filled = min(width, round(width * (c.done + c.failed) / total))
    bar = "#" * filled + "-" * (width - filled)
    return (
        f"run {ev.run_id} [{bar}] {c.done + c.failed}/{c.total}  done {c.done}  "
        f"failed {c.failed}  running {c.running}  {_state_name(ev.state)}"
    )


def _event_line(ev: pb.RunEvent) -> str:
    parts = [f"run {ev.run_id}", f"#{ev.sequence}", _short(pb.RunEventType.Name(ev.type))]
    if ev.HasField("task_index"):
        parts.append(f"task {ev.task_index}")
    if ev.HasField("member_index"):
        parts.append(f"member {ev.member_index}")
    if ev.HasField("worker_id"):
        parts.append(f"worker {ev.worker_id}")
    if ev.outcome:
        parts.append(ev.outcome)
    c = ev.counts
    parts.append(f"(done {c.done}/{c.total}, failed {c.failed}, running {c.running})")
    parts.append(_state_name(ev.state))
    if ev.message:
        parts.append("- " + ev.message.splitlines()[0])
    return " ".join(parts)


def _watch(c: Client, run_id: int, out: Out, timeout: float | None = None) -> int:
    tty = not out.json and out.stream.isatty()
    last: pb.RunEvent | None = None
    for ev in c.watch(run_id):
        last = ev
        if out.json:
            print(json.dumps(to_dict(ev)), file=out.stream, flush=True)
        elif tty:
            print("\r\x1b[2K" + _progress(ev), end="", file=out.stream, flush=True)
        else:
            out.line(_event_line(ev))
        if ev.type == pb.RUN_EVENT_TYPE_RUN_STATE and ev.state in TERMINAL_STATES:
            break
    if tty:
        print(file=out.stream)
    if last is None or last.state not in TERMINAL_STATES:
        return EXIT_TIMEOUT
    if last.state != pb.RUN_STATE_COMPLETED and not out.json:
        status = c.wait_run(run_id, 0)
        if status.error.message:
            print(
                f"simplerctl: run {run_id} {_state_name(last.state)}: {status.error.message}",
                file=sys.stderr,
            )
    return EXIT_OK if last.state == pb.RUN_STATE_COMPLETED else EXIT_FAILED


def cmd_watch(c: Client, a: argparse.Namespace, out: Out) -> int:
    return _watch(c, a.run, out)


def cmd_wait(c: Client, a: argparse.Namespace, out: Out) -> int:
    status = c.wait_run(a.run, a.timeout)
    _print_status(out, status)
    if status.state not in TERMINAL_STATES and not out.json:
        out.line(f"  still {_state_name(status.state)} after {a.timeout}s")
    return _status_exit(status)


def cmd_cancel(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.cancel(a.run, a.reason)
    if out.json:
        out.data({"run_id": a.run, **to_dict(response)})
    elif response.already_finished:
        out.line(f"run {a.run} had already finished ({_state_name(response.state)})")
    else:
        out.line(f"run {a.run} cancelled ({_state_name(response.state)})")
    return EXIT_OK


def cmd_drain(c: Client, a: argparse.Namespace, out: Out) -> int:
    response = c.drain(a.grace, a.shutdown)
    if out.json:
        out.data(to_dict(response))
    else:
        out.line(
            f"drained: {response.runs_finished} runs finished, {response.runs_cancelled} cancelled"
        )
    return EXIT_OK


# --------------------------------------------------------------------------- main


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive run id")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"simplerctl: error: {message}", file=sys.stderr)
        raise _Exit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="machine-readable JSON output",
    )
    ap = _Parser(prog="simplerctl", description="Client of simpler-daemon.", parents=[common])
    ap.add_argument("--version", action="version", version=f"simplerctl {__version__}")
    ap.add_argument(
        "--socket",
        metavar="PATH|HOST:PORT",
        help="daemon address (default: $SIMPLER_DAEMON_SOCKET or the default socket)",
    )
    ap.add_argument("--token-file", help="bearer token for a TCP daemon")
    ap.add_argument("--tls-ca", help="CA bundle that signed a TCP daemon's certificate")
    ap.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    ap.add_argument("--tls-key", help="client key (mutual TLS)")
    ap.add_argument("--server-name", help="name to check the daemon's certificate against")
    ap.add_argument("--rpc-timeout", type=_seconds, default=30.0, help="per-call deadline (30 s)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, fn: Callable[..., int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, parents=[common])
        p.set_defaults(fn=fn)
        return p

    add("info", cmd_info, "daemon version, level, heap, limits")
    add("workers", cmd_workers, "every worker and its state")
    add("callables", cmd_callables, "every registered callable")
    p = add("register", cmd_register, "register a callable by import path")
    p.add_argument("path", metavar="PATH", help="module:qualname")
    p.add_argument("--kind", choices=("sub", "chip", "orchestration"), default="sub")
    p = add("submit", cmd_submit, "submit a run spec (JSON or TOML)")
    p.add_argument("file", metavar="FILE", help="run spec; '-' reads JSON from stdin")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="wait for the run and print its status")
    g.add_argument("--watch", action="store_true", help="show live progress until it ends")
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (default: until it ends)")
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the same run")
    p.add_argument("--label", help="label shown in events and logs")
    p = add("watch", cmd_watch, "live progress of a run until it ends")
    p.add_argument("run", type=_positive_int, metavar="RUN")
    p = add("wait", cmd_wait, "wait for a run to end")
    p.add_argument("run", type=_positive_int, metavar="RUN")
    p.add_argument("--timeout", type=_seconds, help="seconds to wait (default: until it ends)")
    p = add("cancel", cmd_cancel, "cancel a run")
    p.add_argument("run", type=_positive_int, metavar="RUN")
    p.add_argument("--reason", default="", help="recorded in the run's error")
    add("buffers", cmd_buffers, "every live buffer")
    p = add("drain", cmd_drain, "stop admitting runs; optionally stop the daemon")
    p.add_argument("--grace", type=_seconds, help="seconds admitted runs get (default: config)")
    p.add_argument("--shutdown", action="store_true", help="stop the daemon afterwards")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``simplerctl``; returns the exit status."""
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except _Exit as exc:
        return exc.code
    out = Out(getattr(args, "json", False))
    if not getattr(args, "command", None):
        ap.print_usage(sys.stderr)
        out.error("", "a command is required (see --help)")
        return EXIT_USAGE
    if args.socket is None and (args.token_file or args.tls_ca):
        out.error("", "--token-file/--tls-ca need --socket HOST:PORT")
        return EXIT_USAGE
    try:
        client = Client(
            args.socket,
            token_file=args.token_file,
            root_certificates=args.tls_ca,
            client_cert=args.tls_cert,
            client_key=args.tls_key,
            server_name=args.server_name,
            timeout=args.rpc_timeout or None,
        )
    except (OSError, ValueError) as exc:
        out.error("", f"cannot connect: {exc}")
        return EXIT_USAGE
    try:
        with client:
            return int(args.fn(client, args, out))
    except SpecError as exc:
        out.error("INVALID_SPEC", str(exc))
        return EXIT_USAGE
    except _RpcAt as exc:
        return _rpc_failed(out, exc.rpc, client.target, where=exc.where)
    except grpc.RpcError as exc:
        return _rpc_failed(out, exc, client.target)
    except KeyboardInterrupt:
        out.error("", "interrupted")
        return 130


def _rpc_failed(out: Out, exc: grpc.RpcError, target: str, where: str = "") -> int:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not where:
        details = f"cannot reach the daemon at {target}: {details}"
    if where:
        details = f"{where}: {details}"
    out.error(code.name, details or code.name)
    return _STATUS_EXIT.get(code, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
