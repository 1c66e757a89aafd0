"""A throw-away unprivileged user for tests that need a second local identity.

Created with ``useradd --system`` under a random name and always removed; a test
that cannot create one (not root, no useradd/userdel/setpriv) is skipped with the
reason. Run code as the user with ``setpriv --reuid/--regid --clear-groups``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from typing import NamedTuple

import pytest


class User(NamedTuple):
    name: str
    uid: int
    gid: int


@contextlib.contextmanager
def throwaway_user() -> Iterator[User]:
    """A new unprivileged user for the block; skips the test when one cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a second unprivileged user")
    missing = [t for t in ("useradd", "userdel", "setpriv") if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to create and act as a second user")
    name = f"simpler-test-{secrets.token_hex(4)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True, timeout=30)
