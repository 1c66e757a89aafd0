"""The committed gRPC stubs match protos/ and import from inside the package."""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (a test dependency) is not installed")

from simpler_daemon.protocol import gen_proto

EXPECTED_METHODS = {
    # name: (client streaming, server streaming)
    "GetInfo": (False, False),
    "ListWorkers": (False, False),
    "RegisterCallable": (False, False),
    "UnregisterCallable": (False, False),
    "KeepSession": (True, True),
    "ListCallables": (False, False),
    "AllocBuffer": (False, False),
    "WriteBuffer": (True, False),
    "ReadBuffer": (False, True),
    "FreeBuffer": (False, False),
    "ListBuffers": (False, False),
    "SubmitRun": (False, False),
    "RunOrchestration": (False, False),
    "WatchRun": (False, True),
    "WaitRun": (False, False),
    "CancelRun": (False, False),
    "ListRuns": (False, False),
    "GetRunTrace": (False, False),
    "AddRemoteWorker": (False, False),
    "Drain": (False, False),
    "Resume": (False, False),
}


def test_committed_stubs_are_current() -> None:
    problems = gen_proto.check()
    assert not problems, "\n".join(
        ["stubs are stale; run: python -m simpler_daemon.protocol.gen_proto", *problems]
    )


def test_check_detects_stale_and_missing_files(tmp_path: Path) -> None:
    copy = tmp_path / "_proto"
    shutil.copytree(gen_proto.OUT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert gen_proto.check(copy) == []

    pb2 = copy / "simpler/daemon/v1/daemon_pb2.py"
    pb2.write_text(pb2.read_text().replace("GetInfoRequest", "GetInfoRequesd"))
    (copy / "simpler/daemon/v1/__init__.py").unlink()
    (copy / "stray.py").write_text("")
    problems = gen_proto.check(copy)
    assert any(p.startswith("stale: simpler/daemon/v1/daemon_pb2.py") for p in problems)
    assert "missing: simpler/daemon/v1/__init__.py" in problems
    assert "not generated (remove it): stray.py" in problems


def test_stubs_import_from_the_package() -> None:
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2, daemon_pb2_grpc

    service = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"]
    assert service.full_name == "simpler.daemon.v1.Daemon"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == EXPECTED_METHODS
    for name in EXPECTED_METHODS:
        assert hasattr(daemon_pb2_grpc.DaemonServicer, name)
    assert callable(daemon_pb2_grpc.add_DaemonServicer_to_server)


def test_messages_round_trip() -> None:
    from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

    request = pb.SubmitRunRequest(
        idempotency_key="k-1",
        tasks=[
            pb.Task(
                kind=pb.TASK_KIND_NEXT_LEVEL_GROUP,
                hashid="sha256:" + "0" * 64,
                members=[
                    pb.Args(
                        tensors=[
                            pb.TensorRef(
                                buffer_id=1,
                                byte_offset=64,
                                shape=[4, 4],
                                dtype="float32",
                                strides=[16, 4],
                                tag=pb.TAG_INOUT,
                            )
                        ],
                        scalars=[7, 2**64 - 1],
                    ),
                    pb.Args(scalars=[1]),
                ],
                workers=[0, 1],
                config=pb.CallConfig(deadline_ms=500, enable_profile=True, output_prefix="/tmp/p"),
            )
        ],
    )
    decoded = pb.SubmitRunRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.tasks[0].members[0].scalars[1] == 2**64 - 1
    # Messages carry the package module name, so they pickle (multiprocessing, caches).
    assert type(decoded).__module__ == "simpler_daemon.protocol._proto.simpler.daemon.v1.daemon_pb2"
    assert pickle.loads(pickle.dumps(decoded)) == decoded

    event = pb.RunEvent(run_id=3, type=pb.RUN_EVENT_TYPE_SNAPSHOT, state=pb.RUN_STATE_EXECUTING)
    assert not event.HasField("worker_id")  # proto3 optional: absent, not 0
    event.worker_id = 0
    assert event.HasField("worker_id")
    write = pb.WriteBufferRequest(target=pb.WriteBufferTarget(buffer_id=1, offset=0))
    assert write.WhichOneof("chunk") == "target"
    assert pb.WriteBufferRequest(data=b"xy").WhichOneof("chunk") == "data"


def test_check_compares_descriptors_across_generator_versions(tmp_path: Path) -> None:
    """Stubs made by another grpcio-tools release differ in layout, not in meaning."""
    copy = tmp_path / "_proto"
    shutil.copytree(gen_proto.OUT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    grpc_py = copy / "simpler/daemon/v1/daemon_pb2_grpc.py"
    text = grpc_py.read_text()
    grpc_py.write_text(
        re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '0.0.1'", text)
    )
    pb2 = copy / "simpler/daemon/v1/daemon_pb2.py"
    pb2.write_text(pb2.read_text().replace("_sym_db = ", "_sym_db  =  "))
    assert gen_proto.check(copy) == []

    pb2.write_text(pb2.read_text().replace("GetInfoRequest", "GetInfoRequesd"))
    assert gen_proto.check(copy) == [
        "stale: simpler/daemon/v1/daemon_pb2.py (its proto descriptor differs)"
    ]
