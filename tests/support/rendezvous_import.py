"""Imported by SUB children through a REGISTER_IMPORT control; the import is a rendezvous.

Each importing child creates ``<SIMPLER_TEST_RENDEZVOUS_DIR>/<pid>``, then waits until
``SIMPLER_TEST_RENDEZVOUS_N`` children have done so, then sleeps
``SIMPLER_TEST_IMPORT_SLEEP`` seconds. The import can only succeed when the parent
sends the control to all of them at once: sent one child after the other, the first
import gives up after ``SIMPLER_TEST_RENDEZVOUS_WAIT`` seconds and raises ImportError.
The parent must never import this module itself.
"""

from __future__ import annotations

import os
import time
from typing import Any

_dir = os.environ["SIMPLER_TEST_RENDEZVOUS_DIR"]
_n = int(os.environ.get("SIMPLER_TEST_RENDEZVOUS_N", "2"))
_wait = float(os.environ.get("SIMPLER_TEST_RENDEZVOUS_WAIT", "20"))
with open(os.path.join(_dir, str(os.getpid())), "w") as _f:
    _f.write(str(time.monotonic_ns()))
_deadline = time.monotonic() + _wait
while len(os.listdir(_dir)) < _n:
    if time.monotonic() > _deadline:
        raise ImportError(
            f"rendezvous: only {len(os.listdir(_dir))} of {_n} imports started within {_wait}s"
        )
    time.sleep(0.005)
time.sleep(float(os.environ.get("SIMPLER_TEST_IMPORT_SLEEP", "2.0")))


def fn(args: Any) -> None:
    """Never reached by the tests; registering it is what takes time."""
