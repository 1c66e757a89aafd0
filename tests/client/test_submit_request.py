"""The SubmitRunRequest a client builds (``client/requests.py``).

Past ``_COPIED_TASKS`` tasks the request is filled from each distinct Task object's
encoding, parsed once, instead of copying every message: it must be the very request
the plain constructor builds (same tasks, same bytes), for a repeated task, distinct
ones and an iterator alike; and a list that is not all Task messages keeps the
constructor's own error.
"""

from __future__ import annotations

import pytest

from simpler_daemon.client import sub_task
from simpler_daemon.client.requests import _COPIED_TASKS, submit_request
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb

HASHID = "sha256:" + "ab" * 32


def plain(tasks: list[pb.Task]) -> pb.SubmitRunRequest:
    """What the constructor alone builds."""
    request = pb.SubmitRunRequest(
        tasks=tasks, idempotency_key="k", label="lbl", priority=3, include_results=True
    )
    request.wait_seconds = 2.5
    return request


@pytest.mark.parametrize("n", [_COPIED_TASKS, _COPIED_TASKS + 1, 5000])
def test_a_big_request_is_the_constructors_request(n: int) -> None:
    one = sub_task(HASHID, scalars=[7])
    other = sub_task(HASHID, scalars=[8, 9])
    tasks = [one if i % 3 else other for i in range(n)]
    got = submit_request(tasks, "k", "lbl", 2.5, 3, True)
    want = plain(tasks)
    assert list(got.tasks) == tasks
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    from_iter = submit_request(iter(tasks), "k", "lbl", 2.5, 3, True)
    assert from_iter == want


def test_a_big_list_with_a_stranger_keeps_the_constructors_error() -> None:
    tasks: list[object] = [sub_task(HASHID)] * (_COPIED_TASKS + 10)
    tasks[-1] = pb.Args()  # a message, but not a Task
    with pytest.raises(TypeError):
        submit_request(tasks, "k", "", None)  # type: ignore[arg-type]
