"""Imported by a child through a REGISTER_IMPORT control: the import itself is slow.

Before sleeping it creates the file named by ``SIMPLER_TEST_IMPORT_MARKER`` (set
by the test before it forks), so the parent knows the child is inside the
control. The parent must never import this module itself.
"""

from __future__ import annotations

import os
import time
from typing import Any

_marker = os.environ.get("SIMPLER_TEST_IMPORT_MARKER")
if _marker:
    with open(_marker, "w") as _f:
        _f.write(str(os.getpid()))
time.sleep(float(os.environ.get("SIMPLER_TEST_IMPORT_SLEEP", "1.0")))


def fn(args: Any) -> None:
    """Never reached by the tests; registering it is what takes time."""
