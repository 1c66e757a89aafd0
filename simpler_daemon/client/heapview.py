"""Same-host zero-copy access to the daemon's shared heap (``Client.map_buffer``).

A local client maps only the pages of one buffer, from a heap file it trusts, so a
NumPy array over them is shared with the tasks without any copy.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Any

import numpy as np

from simpler_daemon.errors import UntrustedPathError
from simpler_daemon.heap import SHM_DIR
from simpler_daemon.system.localtrust import open_trusted_heap

__all__ = ["map_buffer_view"]


def map_buffer_view(info: Any, daemon_uid: int | None) -> np.ndarray[Any, Any]:
    """Zero-copy view of the buffer a ``BufferInfo`` describes (same host only).

    Only the pages holding that buffer are mapped, never the whole heap (the other
    buffers may be other clients'), and only from a heap file the client trusts: a
    regular file (not a symlink) owned by the client's user, root or the daemon's
    user (``daemon_uid``: the owner of the trusted socket directory; None over TCP),
    that nobody else can write."""
    buffer_id = info.buffer_id
    name = info.heap_name
    if not name:
        raise ValueError(
            f"cannot map buffer {buffer_id}: the daemon's heap is not shared "
            "(workers.heap_shared = false); use write_buffer / read_buffer"
        )
    if "/" in name or not name.startswith("simpler-heap-"):
        raise ValueError(f"cannot map buffer {buffer_id}: unexpected heap name {name!r}")
    dt = np.dtype(info.dtype)
    shape = tuple(int(d) for d in info.shape)
    need = math.prod(shape) * dt.itemsize
    offset, nbytes = int(info.heap_offset), int(info.nbytes)
    if need > nbytes:
        raise ValueError(
            f"cannot map buffer {buffer_id}: shape {shape} of {dt.name} needs {need} "
            f"bytes, the buffer has {nbytes}"
        )
    path = os.path.join(SHM_DIR, name)
    owners = {0, os.geteuid()}
    if daemon_uid is not None:
        owners.add(daemon_uid)
    try:
        fd, size = open_trusted_heap(path, owners)
    except UntrustedPathError as exc:
        raise ValueError(f"cannot map buffer {buffer_id}: {exc}") from exc
    except OSError as exc:
        raise ValueError(
            f"cannot map buffer {buffer_id}: heap {path}: {exc.strerror} "
            "(map_buffer works on the daemon's host, as its user)"
        ) from exc
    try:
        if offset + nbytes > size:
            raise ValueError(
                f"cannot map buffer {buffer_id}: its bytes [{offset}, {offset + nbytes}) "
                f"lie outside heap {path} of {size} bytes"
            )
        if need == 0:
            return np.zeros(shape, dtype=dt)  # no bytes to share: nothing to map
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(fd, offset + need - start, flags=mmap.MAP_SHARED, offset=start)
    finally:
        os.close(fd)
    # The array keeps ``region`` alive; it is unmapped when the array is collected.
    return np.ndarray(shape, dtype=dt, buffer=region, offset=offset - start)
