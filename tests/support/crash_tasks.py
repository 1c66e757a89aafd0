"""What runs in the children of the crash table (faults/test_crash_table.py): one task, one
chip kernel and one L3 orchestration that fault the way ``scalars[0]`` says (``MODE``),
and the probe that names the processes a run reached.

Module level: inherited through fork (the task and the orchestrations) or imported by
path (``tests.support.crash_tasks:misbehave_kernel``, a chip kernel).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import threading
import time
from typing import Any

from simpler_daemon import Tag, TaskArgs
from simpler_daemon.callables import spec_for_object
from tests.support import sub_tasks as tasks

#: How long the task that ignores its deadline keeps running when nobody stops it: far
#: past the deadline, short enough that an engine which lets it finish fails the cell quickly.
IGNORE_S = 5.0
#: Longest wait for one failure, replacement or run (generous: the machine is shared).
WAIT_S = 30.0

# What the task does: the faults, plus a quick success and the idle-exit arming.
MODE = {"sigkill": 1, "sigsegv": 2, "exit3": 3, "sigstop": 4, "deadline": 5}
QUICK, ARM_EXIT = 0, 6


def _misbehave(rec: Any, flag: Any, mode: int) -> None:
    """rec[0] = pid; then fault the way ``mode`` says.

    Before a fault a grandchild (``sleep``) is spawned into the child's process group and
    its pid stored in rec[1]: killing and replacing the child must not leave it behind.
    """
    rec[0] = os.getpid()
    if mode == QUICK:
        return
    if mode == ARM_EXIT:
        # The child exits on its own once it is idle again: the test raises flag[0]
        # only after this run has completed.
        def exit_when_told() -> None:
            deadline = time.monotonic() + WAIT_S
            while flag[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            os._exit(3)

        threading.Thread(target=exit_when_told, daemon=True).start()
        return
    rec[1] = os.posix_spawn("/bin/sleep", ["sleep", "60"], dict(os.environ))
    if mode == MODE["sigkill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == MODE["sigsegv"]:
        faulthandler.disable()  # keep the test output quiet
        ctypes.string_at(0)
    elif mode == MODE["exit3"]:
        os._exit(3)
    elif mode == MODE["sigstop"]:
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # only reached if someone sends SIGCONT
    elif mode == MODE["deadline"]:
        _ignore_alarms()
        time.sleep(IGNORE_S)
        return  # reported as COMPLETED by an engine that trusts the task
    raise AssertionError(f"mode {mode}: still alive")


def _ignore_alarms() -> None:
    """Swallow and block SIGALRM: the cooperative deadline cannot stop this task."""
    with contextlib.suppress(ValueError):  # not the main thread (a chip's device thread)
        signal.signal(signal.SIGALRM, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})


def misbehave(args: Any) -> None:
    """SUB task: tensors = [rec int64[4], flag int64[2]], scalars = [mode]."""
    _misbehave(args.tensors[0], args.tensors[1], args.scalars[0])


def misbehave_kernel(args: Any, config: Any) -> None:
    """Chip kernel: the same, on the chip child's device thread."""
    _misbehave(args.tensors[0], args.tensors[1], args.scalars[0])


def misbehave_orch(o: Any, a: Any, c: Any) -> None:
    """L3 orchestration: the same, inside the L3 child itself."""
    _misbehave(a.tensors[0], a.tensors[1], a.scalars[0])


SUB_PROBE = spec_for_object(tasks.record_pid).handle  # what the inner Worker registers


def probe_orch(o: Any, a: Any, c: Any) -> None:
    """L3 orchestration: rec[0] = the L3 child's pid; rec[2] = its SUB grandchild's pid."""
    a.tensors[0][0] = os.getpid()
    o.submit_sub(SUB_PROBE, TaskArgs().add_tensor(a.tensors[0], Tag.NO_DEP).add_scalar(2))
