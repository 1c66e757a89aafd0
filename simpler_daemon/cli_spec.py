"""simplerctl run specs: a JSON/TOML file -> buffers created in the daemon -> ``Task`` messages.

::

    load_spec(path) -> dict --SpecBuilder.buffers()--> AllocBuffer + WriteBuffer per [buffers.X]
                            --SpecBuilder.tasks()----> RegisterCallable per import path
                                                       -> list[pb.Task] for SubmitRun

Every validation error is a :class:`SpecError` naming the dotted key
(``tasks[2].members[0].tensors[1].buffer``); an RPC that fails while building
is a :class:`SpecRpcError` carrying the key it was made for.
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from collections.abc import Mapping
from typing import Any, Final

import grpc
import numpy as np

from simpler_daemon.client import Client, call_config, make_args, task, tensor
from simpler_daemon.server._proto.simpler.daemon.v1 import daemon_pb2 as pb

__all__ = ["SpecBuilder", "SpecError", "SpecRpcError", "get_field", "load_spec"]

_SUB_KINDS: Final = ("sub", "sub_group")
_TASK_KINDS: Final = ("sub", "sub_group", "next_level", "next_level_group")


class SpecError(ValueError):
    """A run spec that cannot be turned into a SubmitRun; names the key."""


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


def get_field(
    d: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = None
) -> Any:
    """``d[key]`` checked against ``kind`` (``default`` when absent); ``SpecError`` names it."""
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise SpecError(f"{where}.{key}: expected {names}, got {type(value).__name__}")
    return value


def _ints(d: Mapping[str, Any], key: str, where: str) -> list[int]:
    values = get_field(d, key, where, list, [])
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
        table = get_field(spec, "buffers", "spec", dict, {})
        for name, b in table.items():
            where = f"buffers.{name}"
            if not isinstance(b, dict):
                raise SpecError(f"{where}: expected a table with shape and dtype")
            shape = tuple(_ints(b, "shape", where))
            dtype = get_field(b, "dtype", where, str, "float32")
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
        offset = get_field(t, "offset", where, int, 0)
        dtype = get_field(t, "dtype", where, str, bdtype)
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
                get_field(t, "tag", where, (str, int), "input"),
                shape,
                dtype,
                byte_offset=offset,
                strides=_ints(t, "strides", where) or None,
                generation=get_field(t, "generation", where, int, 0),
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
            tensors = get_field(member, "tensors", mw, list, [])
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
                raise SpecRpcError(f"{where}.callable", exc) from exc
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
            kind = get_field(t, "kind", where, str, "sub").lower()
            if kind not in _TASK_KINDS:
                raise SpecError(f"{where}.kind: {kind!r} is not one of {', '.join(_TASK_KINDS)}")
            target = get_field(t, "callable", where, str, "")
            if not target:
                raise SpecError(f"{where}.callable: required (an import path or a hashid)")
            config = None
            if "config" in t:
                cfg = get_field(t, "config", where, dict)
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


class SpecRpcError(Exception):
    def __init__(self, where: str, exc: grpc.RpcError) -> None:
        super().__init__(where)
        self.where = where
        self.rpc = exc
