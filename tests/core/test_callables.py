"""Callable identity: descriptors, hashids, registry refcounts and tombstones,
the child slot table. Pure, no fork."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import cloudpickle
import pytest

from simpler_daemon.callables import (
    CallableKind,
    CallableRegistry,
    SlotTable,
    chip_descriptor,
    digest_of,
    hashid_of,
    hashid_of_digest,
    import_descriptor,
    importable_path,
    load_spec,
    not_registered_message,
    parse_import_path,
    resolve_import,
    serialized_descriptor,
    spec_for_chip,
    spec_for_import,
    spec_for_object,
    verify_hashid,
)
from simpler_daemon.errors import RegistrationError
from tests.support import sub_tasks


def _lp(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def code_of(excinfo: pytest.ExceptionInfo[RegistrationError]) -> str:
    return excinfo.value.code


# -- descriptors and hashids ---------------------------------------------------------------


def test_import_descriptor_is_canonical() -> None:
    desc = import_descriptor("tests.support.sub_tasks", "noop")
    expected = struct.pack("<II", 1, 3) + _lp(b"tests.support.sub_tasks") + _lp(b"noop")
    assert desc == expected
    hid = hashid_of(desc)
    assert hid == "sha256:" + hashlib.sha256(expected).hexdigest()
    spec = spec_for_import(" tests.support.sub_tasks:noop ")  # trimmed
    assert spec.handle.hashid == hid and spec.handle.kind is CallableKind.PYTHON_IMPORT
    assert (
        spec.import_path == "tests.support.sub_tasks:noop" and spec.handle.name == spec.import_path
    )
    assert spec.handle.digest == bytes.fromhex(hid[7:]) == digest_of(hid)
    assert hashid_of_digest(spec.handle.digest) == hid


def test_serialized_and_chip_descriptors() -> None:
    payload = b"some cloudpickle bytes"
    assert serialized_descriptor(payload) == struct.pack("<II", 1, 2) + _lp(
        hashlib.sha256(payload).digest()
    )
    chip = chip_descriptor("sim", "python", b"pkg.mod:kernel", b"sig")
    assert chip == struct.pack("<II", 1, 1) + b"".join(
        _lp(x)
        for x in (
            b"sim",
            b"python",
            hashlib.sha256(b"pkg.mod:kernel").digest(),
            hashlib.sha256(b"sig").digest(),
        )
    )
    spec = spec_for_chip("pkg.mod:kernel")
    assert spec.handle.kind is CallableKind.CHIP_CALLABLE and spec.handle.role == "chip"
    assert spec.handle.hashid == hashid_of(
        chip_descriptor("sim", "python", b"pkg.mod:kernel", b"kernel(args, config)")
    )
    # The kind is part of the identity: same text, different kinds, different hashids.
    assert spec.handle.hashid != spec_for_import("pkg.mod:kernel").handle.hashid


def test_spec_for_object_importable_and_local() -> None:
    spec = spec_for_object(sub_tasks.noop)
    assert spec.handle.kind is CallableKind.PYTHON_SERIALIZED
    assert spec.import_path == "tests.support.sub_tasks:noop"  # shipped by path after init
    assert spec.obj is sub_tasks.noop and spec.payload is not None
    assert spec.handle.hashid == hashid_of(serialized_descriptor(spec.payload))
    assert spec_for_object(sub_tasks.noop).handle.hashid == spec.handle.hashid  # stable

    def local(args: Any) -> int:
        return 41 + 1

    lspec = spec_for_object(local)
    assert lspec.import_path is None and lspec.payload is not None  # shipped serialized
    assert "<locals>" in lspec.handle.name
    assert load_spec(None, lspec.payload)(None) == 42
    assert spec_for_object(local, "orchestration").handle.role == "orchestration"
    with pytest.raises(TypeError, match="not callable"):
        spec_for_object(42)  # type: ignore[arg-type]


def test_importable_path() -> None:
    assert importable_path(sub_tasks.gate) == "tests.support.sub_tasks:gate"
    assert importable_path(lambda a: a) is None
    alias = sub_tasks.noop

    def shadow(args: Any) -> None: ...

    shadow.__module__, shadow.__qualname__ = "tests.support.sub_tasks", "noop"
    assert importable_path(alias) is not None
    assert importable_path(shadow) is None  # importing the path yields another object


# -- hashid format -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "sha256:",
        "sha256:" + "0" * 63,
        "sha256:" + "0" * 65,
        "sha256:" + "A" * 64,  # uppercase
        "sha256:" + "g" * 64,
        "SHA256:" + "0" * 64,
        "sha1:" + "0" * 64,
        "0" * 64,
        " sha256:" + "0" * 64,
        None,
        b"sha256:" + b"0" * 64,
    ],
)
def test_bad_hashids_are_format_invalid(bad: Any) -> None:
    with pytest.raises(RegistrationError) as ei:
        digest_of(bad)
    assert ei.value.code == "HASHID_FORMAT_INVALID"
    assert str(ei.value).startswith("HASHID_FORMAT_INVALID: ")
    reg = CallableRegistry()
    with pytest.raises(RegistrationError) as ei2:
        reg.begin_unregister(bad)
    assert ei2.value.code == "HASHID_FORMAT_INVALID"


@pytest.mark.parametrize(
    "bad",
    [
        "os.path",  # no colon
        "a:b:c",  # two colons
        ".rel:x",  # relative module
        "..pkg.mod:x",
        "m:<locals>.f",
        "m:f.<locals>.g",
        "m:<lambda>",
        ":f",
        "m:",
        "m.:f",
        "1mod:f",
        "m:1f",
        "m:f.",
        "my-mod:f",
        "m:f g",
        "",
        "   ",
    ],
)
def test_bad_import_paths_are_format_invalid(bad: str) -> None:
    with pytest.raises(RegistrationError) as ei:
        parse_import_path(bad)
    assert ei.value.code == "HASHID_FORMAT_INVALID"
    assert repr(bad) in str(ei.value)
    for make in (spec_for_import, spec_for_chip):
        with pytest.raises(RegistrationError) as ei2:
            make(bad)
        assert ei2.value.code == "HASHID_FORMAT_INVALID"


def test_good_import_paths() -> None:
    assert parse_import_path("os.path:join") == ("os.path", "join")
    assert parse_import_path("  pkg._m2:Cls.method ") == ("pkg._m2", "Cls.method")
    assert resolve_import("os.path", "join") is __import__("os.path").path.join
    with pytest.raises(ImportError):
        resolve_import("tests.helpers_missing", "fn")
    with pytest.raises(AttributeError):
        resolve_import("tests.support.sub_tasks", "missing")
    with pytest.raises(TypeError, match="is a int, not a callable"):
        resolve_import("tests.support.sub_tasks", "NOT_A_CALLABLE")


def test_verify_hashid() -> None:
    desc = import_descriptor("m", "f")
    verify_hashid(hashid_of(desc), desc)
    other = hashid_of(import_descriptor("m", "g"))
    with pytest.raises(RegistrationError) as ei:
        verify_hashid(other, desc)
    assert ei.value.code == "HASHID_DESCRIPTOR_MISMATCH"
    assert other in str(ei.value) and hashid_of(desc) in str(ei.value)
    with pytest.raises(RegistrationError) as ei2:
        verify_hashid("sha256:xyz", desc)
    assert ei2.value.code == "HASHID_FORMAT_INVALID"


def test_unserializable_object_is_descriptor_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: Any, **k: Any) -> bytes:
        raise RuntimeError("cannot pickle this")

    monkeypatch.setattr(cloudpickle, "dumps", boom)
    with pytest.raises(RegistrationError) as ei:
        spec_for_object(sub_tasks.noop)
    assert ei.value.code == "HASHID_DESCRIPTOR_MISMATCH" and "cannot pickle this" in str(ei.value)


def test_load_spec() -> None:
    assert load_spec("tests.support.sub_tasks:noop", None) is sub_tasks.noop
    assert load_spec(None, cloudpickle.dumps(sub_tasks.add_one)) is sub_tasks.add_one
    with pytest.raises(TypeError, match="not a callable"):
        load_spec(None, cloudpickle.dumps(7))
    with pytest.raises(ValueError, match="neither an import path nor a payload"):
        load_spec(None, None)
    with pytest.raises(RegistrationError):
        load_spec("os.path", None)


def test_not_registered_message() -> None:
    digest = bytes(range(32))
    assert not_registered_message(digest) == f"callable hash sha256:{digest.hex()} not registered"


# -- parent registry -----------------------------------------------------------------------


def test_registry_refcounts_and_tombstones() -> None:
    reg = CallableRegistry()
    spec = spec_for_import("tests.support.sub_tasks:noop")
    hid = spec.handle.hashid
    assert hid not in reg
    assert reg.begin_register(spec, frozenset({0, 1})) is True  # children must be told
    assert hid not in reg and reg.lookup(hid) is not None  # pending until committed
    with pytest.raises(RegistrationError) as pend:
        reg.get(hid)
    assert pend.value.code == "NOT_REGISTERED"
    reg.commit_register(hid)
    assert hid in reg and reg.get(hid).refcount == 1 and reg.get(hid).workers == frozenset({0, 1})

    assert reg.begin_register(spec, frozenset()) is False  # duplicate: refcount only
    assert reg.begin_register(spec, frozenset()) is False
    assert reg.get(hid).refcount == 3
    assert reg.begin_unregister(hid) is None  # 3 -> 2, nothing to tell the children
    assert reg.begin_unregister(hid) is None  # 2 -> 1
    assert hid in reg

    entry = reg.begin_unregister(hid)  # last reference: tombstone until children confirm
    assert entry is not None and entry.state == "tombstone" and entry.spec is spec
    assert hid not in reg and [e.spec for e in reg.active()] == []
    with pytest.raises(RegistrationError) as t1:
        reg.begin_register(spec, frozenset())
    assert t1.value.code == "REGISTER_TOMBSTONE_ACTIVE"
    with pytest.raises(RegistrationError) as t2:
        reg.begin_unregister(hid)
    assert t2.value.code == "UNREGISTER_TOMBSTONE_ACTIVE"
    with pytest.raises(RegistrationError) as t3:
        reg.get(hid)
    assert t3.value.code == "NOT_REGISTERED"

    reg.finish_unregister(hid)  # every child confirmed
    assert reg.lookup(hid) is None
    with pytest.raises(RegistrationError) as nr:
        reg.begin_unregister(hid)
    assert nr.value.code == "NOT_REGISTERED" and hid in str(nr.value)
    assert reg.begin_register(spec, frozenset()) is True  # reusable again
    reg.commit_register(hid)
    assert reg.get(hid).refcount == 1


def test_registry_abort_and_pending() -> None:
    reg = CallableRegistry()
    spec = spec_for_import("tests.support.sub_tasks:noop")
    hid = spec.handle.hashid
    assert reg.begin_register(spec, frozenset({0}))
    with pytest.raises(RegistrationError) as busy:
        reg.begin_register(spec, frozenset({0}))  # a second registration while one is in flight
    assert busy.value.code == "REGISTER_TOMBSTONE_ACTIVE"
    with pytest.raises(RegistrationError) as nr:
        reg.begin_unregister(hid)  # not registered until committed
    assert nr.value.code == "NOT_REGISTERED"
    reg.abort_register(hid)
    assert reg.lookup(hid) is None
    reg.abort_register(hid)  # harmless
    assert reg.begin_register(spec, frozenset())
    reg.commit_register(hid)
    reg.abort_register(hid)  # never drops an active entry
    assert hid in reg


def test_registry_role_mismatch() -> None:
    reg = CallableRegistry()
    sub = spec_for_import("tests.support.sub_tasks:noop", "sub")
    orch = spec_for_import("tests.support.sub_tasks:noop", "orchestration")
    assert sub.handle.hashid == orch.handle.hashid
    assert reg.begin_register(sub, frozenset())
    reg.commit_register(sub.handle.hashid)
    with pytest.raises(RegistrationError) as ei:
        reg.begin_register(orch, frozenset())
    assert ei.value.code == "HASHID_DESCRIPTOR_MISMATCH"
    assert reg.get(sub.handle.hashid).refcount == 1


def test_unknown_hashid_not_registered() -> None:
    reg = CallableRegistry()
    hid = "sha256:" + "ab" * 32
    for call in (reg.get, reg.begin_unregister):
        with pytest.raises(RegistrationError) as ei:
            call(hid)
        assert ei.value.code == "NOT_REGISTERED"


# -- child slot table ----------------------------------------------------------------------


def test_slot_table_exhaustion_and_reuse() -> None:
    table = SlotTable(capacity=2)
    d1, d2, d3 = (bytes([i]) * 32 for i in (1, 2, 3))
    assert table.add(d1, sub_tasks.noop) == 0
    assert table.add(d2, sub_tasks.add_one) == 1
    with pytest.raises(RegistrationError) as ei:
        table.add(d3, sub_tasks.double)
    assert ei.value.code == "LOCAL_SLOT_EXHAUSTED" and "2 callables" in str(ei.value)
    assert table.resolve(d3) is None and len(table) == 2
    # Re-adding a known digest replaces in place and needs no new slot.
    assert table.add(d1, sub_tasks.gate) == 0
    assert table.resolve(d1) is sub_tasks.gate
    assert table.remove(d1) is True
    assert table.remove(d1) is False
    assert table.resolve(d1) is None and table.slot_of(d1) is None
    assert table.add(d3, sub_tasks.double) == 0  # the freed slot is reused
    assert table.resolve(d3) is sub_tasks.double and table.slot_of(d2) == 1
    assert len(table) == 2
