"""Micro-benchmark: one empty SUB task through one endpoint, driven by a minimal loop.

Not a test: it prints figures. Three measurements, each a median over many
round trips in the same invocation:

* ``spin ping-pong``: a bare shared word bounced between parent and a forked
  child (both spin in C with the GIL released) - the floor for any mailbox.
* ``endpoint, spinning``: ``LocalMailboxEndpoint.submit_progress`` +
  ``poll_progress`` on a real SUB child, both sides spinning.
* ``endpoint, parking``: the same with the child parking on its futex after
  every task (spin budget 0) and the parent sleeping in poll(2) on the
  doorbell, i.e. the cost of a cold wake-up on both sides.

Run: ``python -m benchmarks.micro_endpoint [--n 20000]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import select
import statistics
import time
from typing import Any

from simpler_daemon.args import DEFAULT_CONFIG, encode_args
from simpler_daemon.callables import spec_for_import
from simpler_daemon.children.process import fork_child, reap_all
from simpler_daemon.children.sub import ChildContext, run_child
from simpler_daemon.endpoints.base import EventKind, WorkerDispatch
from simpler_daemon.endpoints.local import LocalMailboxEndpoint
from simpler_daemon.heap import Heap
from simpler_daemon.mailbox import _mailbox as _mb
from simpler_daemon.mailbox.doorbell import Doorbell
from simpler_daemon.mailbox.layout import Mailbox, MailboxState


class _Slot:
    def __init__(self, digest: bytes, hashid: str) -> None:
        self.slot_id = 1
        self.run_id = 1
        self.lease_slot = 0
        self.lease_generation = 1
        self.digest = digest
        self.hashid = hashid
        self.config_bytes = DEFAULT_CONFIG.encode()
        self.blobs = [encode_args([], [])]


def spin_pingpong(n: int) -> list[float]:
    buf = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    pid = os.fork()
    if pid == 0:  # child: echo every sequence number back
        try:
            for i in range(1, n + 1):
                while _mb.spin_wait(buf, (0,), (i - 1,), 1 << 30) < 0:
                    pass
                _mb.store32(buf, 8, i)
        finally:
            os._exit(0)
    samples = []
    try:
        for i in range(1, n + 1):
            t0 = time.perf_counter_ns()
            _mb.store32(buf, 0, i)
            while _mb.spin_wait(buf, (8,), (i - 1,), 1 << 30) < 0:
                pass
            samples.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        os.waitpid(pid, 0)
        buf.close()
    return samples


def endpoint_roundtrips(n: int, *, park: bool) -> list[float]:
    heap = Heap(1 << 20)
    doorbell = Doorbell()
    mb = Mailbox()
    spec = spec_for_import("benchmarks.tasks:empty")
    ctx = ChildContext(
        worker_id=0,
        label="sub worker 0",
        mailbox=mb,
        heap=heap,
        doorbell=doorbell,
        specs=[spec],
        parent_pid=os.getpid(),
        spin_ns=0 if park else 200_000,
    )
    child = fork_child(lambda: run_child(ctx), ctx.label)
    try:
        deadline = time.monotonic() + 10
        while mb.state(0) != MailboxState.INIT_READY:
            if time.monotonic() > deadline or child.poll():
                raise RuntimeError(f"benchmark child did not start: {mb.error_text(0)}")
            time.sleep(0.001)
        mb.set_state(0, MailboxState.IDLE)
        ep = LocalMailboxEndpoint(0, mb, child, label=ctx.label)
        slot = _Slot(spec.handle.digest, spec.handle.hashid)
        poller = select.poll()
        poller.register(doorbell.fd, select.POLLIN)
        events: list[Any] = []
        samples = []
        for i in range(1, n + 1):
            if park:
                time.sleep(0.0002)  # let the child fall asleep: every trip is a cold wake-up
            t0 = time.perf_counter_ns()
            ep.submit_progress(WorkerDispatch(slot, 0, dispatch_id=i))
            while True:
                ep.poll_progress(events)
                if any(e.kind is EventKind.COMPLETED for e in events):
                    break
                if park:
                    doorbell.park()
                    ep.poll_progress(events)
                    if any(e.kind is EventKind.COMPLETED for e in events):
                        doorbell.unpark()
                        break
                    poller.poll(100)
                    doorbell.unpark()
                    doorbell.drain()
            samples.append((time.perf_counter_ns() - t0) / 1000)
            events.clear()
        return samples
    finally:
        mb.request_shutdown()
        reap_all([child], 5.0)
        child.close()
        mb.close()
        doorbell.close()
        heap.close()


def summarize(name: str, samples: list[float]) -> str:
    samples = sorted(samples)
    p99 = samples[int(len(samples) * 0.99) - 1]
    return f"| {name} | {statistics.median(samples):.1f} | {p99:.1f} |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    opts = ap.parse_args(argv)
    rows = [
        summarize("spin ping-pong (shared word)", spin_pingpong(opts.n)),
        summarize("endpoint round trip, spinning", endpoint_roundtrips(opts.n, park=False)),
        summarize(
            "endpoint round trip, parking", endpoint_roundtrips(max(500, opts.n // 10), park=True)
        ),
    ]
    print("| path | median µs | p99 µs |\n| --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
