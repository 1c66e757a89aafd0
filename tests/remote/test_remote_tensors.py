"""Remote tensors at L4, without sockets: specs, descriptor encoding, dependency keys
(owner, buffer, generation, byte range), and the clear errors for a tensor sent to the
wrong kind of worker. The fleet's buffer table is the real one; no session is opened."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from simpler_daemon.args import Tag, TaskArgs, decode_descs
from simpler_daemon.callables import spec_for_chip
from simpler_daemon.engine.orchestrator import Orchestrator, Run, SlotState
from simpler_daemon.engine.remote_l3 import RemoteFleet, _Buffer, _Install
from simpler_daemon.heap import Heap
from simpler_daemon.remote.spec import (
    RemoteCallable,
    RemoteTensorRef,
    RemoteWorkerSpec,
    parse_endpoint,
)
from tests.support.submit_sink import CHIP, SUB, Sink

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def heap() -> Iterator[Heap]:
    h = Heap(1 << 20)
    yield h
    h.close()


@pytest.fixture
def fleet() -> RemoteFleet:
    f = RemoteFleet()
    f.add(1, RemoteWorkerSpec("127.0.0.1:19073"))
    f.add(2, RemoteWorkerSpec("127.0.0.1:19074"))
    # The NEXT_LEVEL callable the tests submit is installed on both remote workers.
    f.installs[CHIP.hashid] = _Install(
        spec_for_chip("tests.support.sub_tasks:kernel"), "orchestration", {1, 2}
    )
    return f


def ref_on(fleet: RemoteFleet, owner: int, buffer_id: int = 7, n: int = 16) -> RemoteTensorRef:
    ref = RemoteTensorRef(owner, buffer_id, 3, (n,), "float32", n * 4)
    fleet.buffers[ref.key] = _Buffer(ref)
    return ref


def sink_with(heap: Heap, fleet: RemoteFleet) -> Sink:
    s = Sink(heap, workers=(0, 1, 2))
    s.remote = fleet
    return s


# -- specs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("10.77.0.2:19073", ("10.77.0.2", 19073)),
        ("localhost:5", ("127.0.0.1", 5)),
        ("[::1]:80", ("::1", 80)),
    ],
)
def test_parse_endpoint_accepts_addresses(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("example.com:19073", "not a numeric address"),
        ("10.0.0.1", "port missing"),
        ("10.0.0.1:0", "out of range"),
        ("10.0.0.1:x", "not a number"),
        ("", "expected 'IP:PORT'"),
    ],
)
def test_parse_endpoint_refuses_with_the_reason(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RemoteWorkerSpec(endpoint)


def test_spec_field_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_sub_workers"):
        RemoteWorkerSpec("127.0.0.1:1", num_sub_workers=-1)
    with pytest.raises(ValueError, match="session_timeout_s"):
        RemoteWorkerSpec("127.0.0.1:1", session_timeout_s=0)
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        RemoteWorkerSpec("127.0.0.1:1", tls_ca_file="ca", tls_cert_file="c")


def test_remote_callable_normalises_and_checks_the_path() -> None:
    assert (
        RemoteCallable(" tests.support.l3_jobs:fill_all ").target
        == "tests.support.l3_jobs:fill_all"
    )
    with pytest.raises(ValueError):
        RemoteCallable("no_colon")


# -- descriptors and dependencies ------------------------------------------------------------------


def test_remote_descriptor_round_trips_with_its_owner(heap: Heap, fleet: RemoteFleet) -> None:
    sink = sink_with(heap, fleet)
    x = ref_on(fleet, owner=1)
    o = Orchestrator(sink, Run())
    o.submit_next_level(CHIP, TaskArgs().add_tensor(x, Tag.INOUT).add_scalar(3), worker=1)
    slot = sink.added[0]
    (desc,), scalars = decode_descs(slot.blobs[0])
    assert desc.remote and desc.buffer_offset == 1 and desc.buffer_id == 7
    assert desc.generation == 3 and desc.shape == (16,) and desc.strides == (4,)
    assert desc.tag is Tag.INOUT and scalars == [3]
    assert slot.pins == [(1, 7, 3, 0)] and fleet.buffers[x.key].pins == 1


def test_dependencies_key_on_owner_buffer_generation(heap: Heap, fleet: RemoteFleet) -> None:
    sink = sink_with(heap, fleet)
    a = ref_on(fleet, owner=1, buffer_id=7)
    same_id_other_owner = ref_on(fleet, owner=2, buffer_id=7)
    o = Orchestrator(sink, Run())
    o.submit_next_level(CHIP, TaskArgs().add_tensor(a, Tag.OUTPUT), worker=1)
    o.submit_next_level(CHIP, TaskArgs().add_tensor(same_id_other_owner, Tag.INPUT), worker=2)
    o.submit_next_level(CHIP, TaskArgs().add_tensor(a, Tag.INPUT), worker=1)
    writer, other, reader = sink.added
    assert other.deps == 0 and other.state == SlotState.READY
    assert reader.deps == 1 and reader in writer.consumers


def test_a_host_array_sent_to_a_remote_worker_is_refused(heap: Heap, fleet: RemoteFleet) -> None:
    sink = sink_with(heap, fleet)
    o = Orchestrator(sink, Run())
    with pytest.raises(ValueError, match=r"tensors\[0\] is a host array.*remote worker 1"):
        o.submit_next_level(CHIP, TaskArgs().add_tensor(heap.alloc(4)), worker=1)
    assert not sink.added


def test_a_remote_tensor_sent_to_a_sub_or_local_worker_is_refused(
    heap: Heap, fleet: RemoteFleet
) -> None:
    sink = sink_with(heap, fleet)
    x = ref_on(fleet, owner=1)
    o = Orchestrator(sink, Run())
    with pytest.raises(ValueError, match="lives on remote worker 1; a SUB worker reads only"):
        o.submit_sub(SUB, TaskArgs().add_tensor(x))
    with pytest.raises(ValueError, match="local worker 0 reads only this host's shared heap"):
        o.submit_next_level(CHIP, TaskArgs().add_tensor(x), worker=0)
    assert not sink.added and fleet.buffers[x.key].pins == 0


def test_a_remote_tensor_of_another_worker_needs_an_import(heap: Heap, fleet: RemoteFleet) -> None:
    sink = sink_with(heap, fleet)
    x = ref_on(fleet, owner=1)
    o = Orchestrator(sink, Run())
    with pytest.raises(ValueError, match=r"worker 2 has not imported it.*import_remote"):
        o.submit_next_level(CHIP, TaskArgs().add_tensor(x), worker=2)
    fleet.buffers[x.key].imported_by.add(2)
    o.submit_next_level(CHIP, TaskArgs().add_tensor(x), worker=2)
    assert len(sink.added) == 1
    # An imported copy is a snapshot: a write there would be lost, so it is refused.
    with pytest.raises(ValueError, match="INOUT, but remote worker 2 holds only a read-only"):
        o.submit_next_level(CHIP, TaskArgs().add_tensor(x, Tag.INOUT), worker=2)


def test_a_ref_from_an_ended_session_never_names_a_new_buffer(
    heap: Heap, fleet: RemoteFleet
) -> None:
    old = RemoteTensorRef(1, 7, 3, (16,), "float32", 64, session=111, session_generation=1)
    # The new session numbered its first buffer the same way: same (owner, id, generation).
    new = RemoteTensorRef(1, 7, 3, (16,), "float32", 64, session=222, session_generation=2)
    fleet.buffers[new.key] = _Buffer(new)
    fleet.live[1] = 2
    o = Orchestrator(sink_with(heap, fleet), Run())
    with pytest.raises(ValueError, match="buffer 7 of session 1 of remote worker 1, which ended"):
        o.submit_next_level(CHIP, TaskArgs().add_tensor(old), worker=1)
    o.submit_next_level(CHIP, TaskArgs().add_tensor(new), worker=1)


def test_a_freed_or_lost_remote_buffer_is_refused(heap: Heap, fleet: RemoteFleet) -> None:
    sink = sink_with(heap, fleet)
    x = ref_on(fleet, owner=1)
    fleet.forget_session(1)  # the session ended: its buffers went with it
    o = Orchestrator(sink, Run())
    with pytest.raises(ValueError, match="which ended: its data is lost"):
        o.submit_next_level(CHIP, TaskArgs().add_tensor(x), worker=1)


def test_a_pinned_remote_buffer_is_kept_until_unpinned(heap: Heap, fleet: RemoteFleet) -> None:
    x = ref_on(fleet, owner=1)
    fleet.pin(x.key)
    fleet.buffers[x.key].freed = True
    fleet.unpin(x.key)
    assert x.key not in fleet.buffers


def test_remote_tensor_ref_strides_and_repr() -> None:
    r = RemoteTensorRef(1, 2, 3, (2, 3), "float64", 48)
    assert r.strides == (24, 8)
    assert "worker=1" in repr(r) and "float64" in repr(r)
    with pytest.raises(ValueError, match="not supported"):
        RemoteTensorRef(1, 2, 3, (2,), "object", 16)
    assert np.dtype(r.dtype).itemsize == 8


def test_a_callable_not_installed_on_the_remote_target_is_refused_at_submit(
    heap: Heap, fleet: RemoteFleet
) -> None:
    fleet.installs[CHIP.hashid].workers = {1}
    sink = sink_with(heap, fleet)
    o = Orchestrator(sink, Run())
    with pytest.raises(ValueError, match=r"not installed on remote worker 2 .*workers=\[2\]"):
        o.submit_next_level(CHIP, TaskArgs(), worker=2)
    with pytest.raises(ValueError, match="not installed on remote worker 2"):
        o.submit_next_level_group(CHIP, [TaskArgs(), TaskArgs()], workers=[1, 2])
    o.submit_next_level(CHIP, TaskArgs(), worker=1)
    assert len(sink.added) == 1
