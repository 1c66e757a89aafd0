"""One SUB child behind a hand-built endpoint, for the endpoint, lane and child-loop tests
(no Scheduler, no Worker).

``Rig`` owns one heap, one doorbell, one mailbox, one forked SUB child and the
``LocalMailboxEndpoint`` that drives it, and tears all of it down in ``close``
(also when a test fails half-way), so the autouse leak guards stay quiet::

    with Rig([spec_for_object(sub_tasks.noop)]) as rig:
        d = rig.submit(digest, blob)
        ev = rig.wait_completed()
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simpler_daemon.args import DEFAULT_CONFIG, CallConfig, Tag, encode_args
from simpler_daemon.callables import CallableSpec
from simpler_daemon.children.process import ChildProcess, fork_child, reap_all
from simpler_daemon.children.sub import ChildContext, run_child
from simpler_daemon.endpoints.base import EndpointEvent, EventKind, WorkerDispatch
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.mailbox.layout import BASE_FRAME, OFF_CHILD_PARKED, Mailbox, MailboxState
from simpler_daemon.testing import poll_for

EMPTY_BLOB = encode_args([], [])


@dataclass
class Slot:
    """The minimal task slot an endpoint reads (see ``SlotView``)."""

    digest: bytes
    blobs: list[bytes]
    slot_id: int = 1
    run_id: int = 1
    lease_slot: int = 0
    lease_generation: int = 1
    config_bytes: bytes = field(default_factory=DEFAULT_CONFIG.encode)
    hashid: str = ""


def blob_for(
    heap: Heap, tensors: Sequence[np.ndarray[Any, Any]] = (), scalars: Sequence[int] = ()
) -> bytes:
    """Encode heap arrays (tagged INOUT) and u64 scalars into an args blob."""
    descs = [heap.describe(t).with_tag(Tag.INOUT) for t in tensors]
    return encode_args(descs, [int(s) & ((1 << 64) - 1) for s in scalars])


class Gate:
    """Three heap words driving ``sub_tasks.gate``: started, release, finished."""

    def __init__(self, heap: Heap) -> None:
        self.words = heap.alloc(3, "uint64")
        self.blob = blob_for(heap, [self.words])

    def started(self) -> bool:
        return bool(self.words[0])

    def release(self) -> None:
        self.words[1] = 1

    def finished(self) -> bool:
        return bool(self.words[2])


class Rig:
    """One SUB child behind one real ``LocalMailboxEndpoint``."""

    def __init__(
        self,
        specs: Sequence[CallableSpec] = (),
        *,
        worker_id: int = 0,
        heap_bytes: int = 1 << 20,
        start: bool = True,
        **ctx_kwargs: Any,
    ) -> None:
        self.heap = Heap(heap_bytes)
        self.doorbell = Doorbell()
        self.mailbox = Mailbox()
        self.label = f"sub worker {worker_id}"
        ctx_kwargs.setdefault("parent_pid", os.getpid())
        self.ctx = ChildContext(
            worker_id=worker_id,
            label=self.label,
            mailbox=self.mailbox,
            heap=self.heap,
            doorbell=self.doorbell,
            specs=list(specs),
            **ctx_kwargs,
        )
        self.child: ChildProcess | None = None
        self._endpoint: LocalMailboxEndpoint | None = None
        self._next_id = 0
        if start:
            try:
                self.start()
            except BaseException:
                self.close()
                raise

    # -- lifecycle -------------------------------------------------------------------

    def fork(self) -> ChildProcess:
        ctx = self.ctx
        self.child = fork_child(lambda: run_child(ctx), self.label)
        return self.child

    def wait_init(self, timeout: float = 10.0) -> int:
        """Wait for INIT_READY or INIT_FAILED (or an early exit) and return the base state."""
        child = self.child
        assert child is not None

        seen: list[int] = []

        def settled() -> bool:
            exited = child.poll()  # before reading the state: a child may publish, then exit
            st = self.mailbox.state(BASE_FRAME)
            if st in (MailboxState.INIT_READY, MailboxState.INIT_FAILED):
                seen.append(st)
            elif exited:
                seen.append(-1)
            return bool(seen)

        poll_for(settled, timeout, message="child never settled init")
        return seen[0]

    def start(self) -> LocalMailboxEndpoint:
        self.fork()
        st = self.wait_init()
        assert st == MailboxState.INIT_READY, (
            f"child init failed: state {st}: {self.mailbox.error_text(BASE_FRAME)}"
        )
        self.mailbox.set_state(BASE_FRAME, MailboxState.IDLE)
        _mb.wake_child(self.mailbox.buf)
        self._endpoint = LocalMailboxEndpoint(
            self.ctx.worker_id,
            self.mailbox,
            self.child,
            label=self.label,
            queue_frame=self.ctx.task_frames == 2,
        )
        return self._endpoint

    @property
    def endpoint(self) -> LocalMailboxEndpoint:
        assert self._endpoint is not None
        return self._endpoint

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if not self.mailbox.closed:
                self.mailbox.request_shutdown()
        if self.child is not None:
            reap_all([self.child], 5.0)
            self.child.close()
        self.mailbox.close()
        self.doorbell.close()
        self.heap.close()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def frozen_while_parked(self, timeout: float = 10.0) -> Iterator[None]:
        """SIGSTOP the child while it is parked and SIGCONT it on exit.

        Whatever the test publishes inside the block is seen by the child all at
        once, at the top of its loop (it resumes from the park).
        """
        child = self.child
        assert child is not None
        buf = self.mailbox.buf

        def parked_and_stopped() -> bool:
            if _mb.load32(buf, OFF_CHILD_PARKED) != 1:
                return False
            os.kill(child.pid, signal.SIGSTOP)
            poll_for(lambda: proc_state(child.pid) == "T", timeout)
            if _mb.load32(buf, OFF_CHILD_PARKED) == 1:
                return True
            os.kill(child.pid, signal.SIGCONT)
            return False

        poll_for(parked_and_stopped, timeout, message="child never parked")
        try:
            yield
        finally:
            os.kill(child.pid, signal.SIGCONT)

    # -- task path -------------------------------------------------------------------

    def dispatch(
        self,
        digest: bytes,
        blob: bytes = EMPTY_BLOB,
        config: CallConfig = DEFAULT_CONFIG,
        **slot_kwargs: Any,
    ) -> WorkerDispatch:
        """A fresh dispatch (new slot id and dispatch id) for ``digest``."""
        self._next_id += 1
        slot_kwargs.setdefault("slot_id", self._next_id)
        slot = Slot(digest, [blob], config_bytes=config.encode(), **slot_kwargs)
        return WorkerDispatch(slot, 0, dispatch_id=self._next_id)

    def submit(self, digest: bytes, blob: bytes = EMPTY_BLOB, **kwargs: Any) -> WorkerDispatch:
        d = self.dispatch(digest, blob, **kwargs)
        self.endpoint.submit_progress(d)
        return d

    def wait_completed(
        self,
        timeout: float = 10.0,
        events: list[EndpointEvent] | None = None,
        on_poll: Callable[[list[EndpointEvent]], None] | None = None,
    ) -> EndpointEvent:
        """Poll the endpoint until a COMPLETED event appears; return it.

        Every event polled is appended to ``events``; ``on_poll`` sees the list
        after each round (to check invariants at the moment an event appears).
        """
        out: list[EndpointEvent] = [] if events is None else events
        ep = self.endpoint

        def step() -> EndpointEvent | None:
            ep.poll_progress(out)
            if on_poll is not None:
                on_poll(out)
            return next((e for e in out if e.kind is EventKind.COMPLETED), None)

        return poll_for(step, timeout, interval=0.001, message="no COMPLETED event")

    def run(
        self, digest: bytes, blob: bytes = EMPTY_BLOB, timeout: float = 10.0, **kwargs: Any
    ) -> EndpointEvent:
        d = self.submit(digest, blob, **kwargs)
        ev = self.wait_completed(timeout)
        assert ev.dispatch is d
        return ev


def proc_state(pid: int) -> str:
    """The one-letter state of a process from /proc (R, S, T, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def completed(events: Sequence[EndpointEvent]) -> list[EndpointEvent]:
    return [e for e in events if e.kind is EventKind.COMPLETED]


def settle(ep: LocalMailboxEndpoint, events: list[EndpointEvent], seconds: float = 0.05) -> None:
    """Keep polling for a while (to show that no further event appears)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ep.poll_progress(events)
        time.sleep(0.001)
