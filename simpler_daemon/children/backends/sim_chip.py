"""The simulated chip backend: a CPU "device" per chip child.

Each chip child owns one device thread (started after fork, inside the
child). ``launch`` queues a prepared token; the device thread crosses the
launch boundary (``on_launch``: the accepted word), runs the kernel
``kernel(args, config)`` over NumPy views of the shared heap, and signals
completion, which ``poll`` observes. Two banks hold prepared state, selected
by the pipeline lease slot.

Failure injection for tests: a kernel may carry ``sim_fail = "prepare" |
"launch" | "poll" | "finalize"``; ``sim_prepare_s`` adds a fixed preparation
time (the staging benchmark uses it). Every phase is appended to an optional
JSON-lines trace (``trace_path``) so tests can check ordering from recorded
backend events.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simpler_daemon.children.backends.base import BackendError


@dataclass
class SimToken:
    bank: int
    dispatch_id: int
    kernel: Callable[..., Any]
    args: Any
    config: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    launched: bool = False
    finalized: bool = False


class SimChipBackend:
    """Runs chip kernels on a device thread of the chip child."""

    supports_concurrent_prepare = True

    def __init__(
        self,
        chip_id: int,
        *,
        pipeline_depth: int = 2,
        trace_path: str | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(f"sim chip {chip_id}: pipeline_depth {pipeline_depth} must be 1 or 2")
        self.chip_id = chip_id
        self.pipeline_depth = pipeline_depth
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None  # noqa: SIM115
        self._on_complete = on_complete
        self._trace_lock = threading.Lock()
        self._banks: list[SimToken | None] = [None, None]
        self._queue: queue.SimpleQueue[SimToken | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._device, name=f"sim-chip-{chip_id}", daemon=True
        )
        self._thread.start()

    # -- lifecycle phases ---------------------------------------------------------------------

    def prepare(
        self, kernel: Callable[..., Any], args: Any, config: Any, bank: int, dispatch_id: int
    ) -> SimToken:
        if self._banks[bank] is not None:
            raise BackendError(
                f"sim chip {self.chip_id}: bank {bank} already holds a prepared token"
            )
        self.trace("prepare", dispatch_id, bank=bank)
        delay = getattr(kernel, "sim_prepare_s", 0.0)
        if delay:
            time.sleep(delay)
        token = SimToken(bank, dispatch_id, kernel, args, config)
        self._banks[bank] = token
        if getattr(kernel, "sim_fail", None) == "prepare":
            # The bank is claimed: the caller still owes this token one finalize.
            raise BackendError(f"sim chip {self.chip_id}: injected prepare failure", token)
        return token

    def launch(self, token: SimToken, on_launch: Callable[[], None]) -> None:
        if getattr(token.kernel, "sim_fail", None) == "launch":
            self.trace("launch_failed", token.dispatch_id)
            raise BackendError(f"sim chip {self.chip_id}: injected launch failure")
        token.launched = True
        token.on_launch = on_launch  # type: ignore[attr-defined]
        self._queue.put(token)

    def poll(self, token: SimToken) -> bool:
        if not token.done.is_set():
            return False
        if getattr(token.kernel, "sim_fail", None) == "poll":
            raise BackendError(f"sim chip {self.chip_id}: injected poll failure")
        if token.error is not None:
            raise BackendError(token.error)
        self.trace("complete", token.dispatch_id)
        return True

    def finalize(self, token: SimToken) -> None:
        if token.finalized:
            raise BackendError(
                f"sim chip {self.chip_id}: token {token.dispatch_id} finalized twice"
            )
        token.finalized = True
        if self._banks[token.bank] is token:
            self._banks[token.bank] = None
        self.trace("finalize", token.dispatch_id, launched=token.launched)
        if getattr(token.kernel, "sim_fail", None) == "finalize":
            raise BackendError(f"sim chip {self.chip_id}: injected finalize failure")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    # -- the device --------------------------------------------------------------------------------

    def _device(self) -> None:
        while True:
            token = self._queue.get()
            if token is None:
                return
            on_launch = getattr(token, "on_launch", None)
            self.trace("launch", token.dispatch_id)
            if on_launch is not None:
                on_launch()
            try:
                token.kernel(token.args, token.config)
            except BaseException as exc:
                token.error = f"chip_worker: {type(exc).__name__}: {exc}\n" + "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                )
            token.done.set()
            if self._on_complete is not None:
                self._on_complete()

    def trace(self, event: str, dispatch_id: int, **extra: Any) -> None:
        if self._trace is not None:
            rec = {
                "t": time.monotonic(),
                "chip": self.chip_id,
                "pid": os.getpid(),
                "event": event,
                "dispatch_id": dispatch_id,
                **extra,
            }
            with self._trace_lock:
                self._trace.write(json.dumps(rec) + "\n")
