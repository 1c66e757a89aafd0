"""Who owns what, and how much each client may hold: the daemon's ownership model.

Every buffer and callable registration a client creates, and every run it submits,
belongs to the caller's :class:`~simpler_daemon.server.peers.Identity` ``.owner``::

    AllocBuffer       --check_alloc (limits.per_client_heap_bytes)--> add_buffer
    Read/Write/Free   --check_buffer: owner or admin, else AccessDenied
    SubmitRun args    --check_buffer for every buffer the plan pinned
    RegisterCallable  --registering: quota limits.per_client_registrations, slot held
                        (a client session's references count until it ends: sessions.py)
    UnregisterCallable--drop_registration: the caller's own reference (an admin: anyone's)
    Cancel/Wait/Watch --check_run: the run record's owner or an admin

A refusal names the object (``buffer 7``, ``run 12``, ``callable sha256:...``) and
never its data or its owner. Quotas apply to admins too: they separate clients, they
are not a privilege. Everything runs on the daemon's event loop: no locks.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Final, NamedTuple

from simpler_daemon.errors import AccessDenied, LimitExceeded
from simpler_daemon.server.config import LimitsConfig
from simpler_daemon.server.peers import DAEMON_OWNER, Identity
from simpler_daemon.system.authguard import read_token_file

__all__ = ["OWNED_BY_OTHER", "Owners", "read_admin_token", "require_admin"]

#: Why an object is refused to a non-owner (the same words for every kind of object).
OWNED_BY_OTHER: Final = "it belongs to another client (only its owner or an admin may)"


def read_admin_token(path: str) -> bytes:
    """The admin token (``security.admin_token_file``); b"" when none is configured.
    The same rules as every bearer token (private file, minimum length: authguard.py)."""
    if not path:
        return b""
    return read_token_file(path, "security.admin_token_file", "admin token")


def require_admin(who: Identity, what: str) -> None:
    """``AccessDenied`` unless ``who`` is an admin (Drain, shutdown, workers)."""
    if not who.admin:
        raise AccessDenied(
            "",
            f"cannot {what}: an admin call ({who.owner} is not an admin: see "
            "security.admin_uids, security.admin_groups, security.admin_token_file)",
        )


class _Owned(NamedTuple):
    owner: str
    generation: int
    nbytes: int


class Owners:
    """The owner of every client buffer and registration; the per-owner quotas."""

    def __init__(self, limits: LimitsConfig) -> None:
        self._limits = limits
        self._buffers: dict[int, _Owned] = {}
        self._heap_bytes: Counter[str] = Counter()
        self._registrations: dict[str, Counter[str]] = {}
        self._registration_count: Counter[str] = Counter()

    def reconfigure(self, limits: LimitsConfig) -> None:
        """New quotas (SIGHUP) for requests from now on; what is held stays held."""
        self._limits = limits

    # -- buffers ---------------------------------------------------------------------

    def heap_bytes(self, owner: str) -> int:
        return self._heap_bytes[owner]

    def check_alloc(self, who: Identity, nbytes: int) -> None:
        """``LimitExceeded`` naming the quota when ``nbytes`` more would exceed it."""
        limit = self._limits.per_client_heap_bytes
        held = self._heap_bytes[who.owner]
        if held + nbytes > limit:
            raise LimitExceeded(
                "shape",
                f"cannot allocate {nbytes} bytes: quota limits.per_client_heap_bytes "
                f"({limit} bytes) exceeded: {who.owner} already holds {held} bytes of buffers",
            )

    def add_buffer(self, who: Identity, buffer_id: int, generation: int, nbytes: int) -> None:
        self._buffers[buffer_id] = _Owned(who.owner, generation, nbytes)
        self._heap_bytes[who.owner] += nbytes

    def owner_of(self, buffer_id: int, generation: int) -> str:
        """The buffer's owner; a buffer no client allocated (an orchestration's own)
        belongs to the daemon."""
        owned = self._buffers.get(buffer_id)
        if owned is None or owned.generation != generation:
            return DAEMON_OWNER
        return owned.owner

    def may_use_buffer(self, who: Identity, buffer_id: int, generation: int) -> bool:
        return who.admin or self.owner_of(buffer_id, generation) == who.owner

    def check_buffer(
        self, who: Identity, buffer_id: int, generation: int, what: str, field: str = ""
    ) -> None:
        """``AccessDenied`` naming the buffer unless ``who`` owns it or is an admin."""
        if not self.may_use_buffer(who, buffer_id, generation):
            raise AccessDenied(field, f"cannot {what} buffer {buffer_id}: {OWNED_BY_OTHER}")

    def drop_buffer(self, buffer_id: int) -> None:
        """The buffer was freed: it stops counting against its owner's quota."""
        owned = self._buffers.pop(buffer_id, None)
        if owned is None:
            return
        left = self._heap_bytes[owned.owner] - owned.nbytes
        if left > 0:
            self._heap_bytes[owned.owner] = left
        else:
            self._heap_bytes.pop(owned.owner, None)

    # -- registrations -----------------------------------------------------------------

    def check_register(self, who: Identity) -> None:
        """``LimitExceeded`` naming the quota when ``who`` holds its limit of references."""
        limit = self._limits.per_client_registrations
        held = self._registration_count[who.owner]
        if held >= limit:
            raise LimitExceeded(
                "",
                f"cannot register a callable: quota limits.per_client_registrations ({limit}) "
                f"reached: {who.owner} holds {held} registrations (unregister some first)",
            )

    @contextlib.contextmanager
    def registering(self, who: Identity) -> Iterator[Callable[[str], None]]:
        """Check the quota and hold a slot while a registration is in flight (concurrent
        calls of one client cannot overshoot it); call the yielded function with the
        hashid once registered, else the slot is given back."""
        self.check_register(who)
        self._registration_count[who.owner] += 1
        done: list[str] = []

        def commit(hashid: str) -> None:
            self._registrations.setdefault(hashid, Counter())[who.owner] += 1
            done.append(hashid)

        try:
            yield commit
        finally:
            if not done:
                self._uncount(who.owner, 1)

    def _uncount(self, owner: str, n: int) -> None:
        left = self._registration_count[owner] - n
        if left > 0:
            self._registration_count[owner] = left
        else:
            self._registration_count.pop(owner, None)

    def references(self, owner: str, hashid: str) -> int:
        """References to ``hashid`` that ``owner`` holds (in sessions or not)."""
        holders = self._registrations.get(hashid)
        return holders[owner] if holders is not None else 0

    def registration_owner(self, who: Identity, hashid: str) -> str:
        """Whose reference an unregister by ``who`` drops: its own when it holds one,
        for an admin anyone's (the daemon's preloaded one last), else AccessDenied."""
        holders = self._registrations.get(hashid, Counter())
        if holders[who.owner] > 0:
            return who.owner
        if who.admin:
            return next((o for o, n in holders.items() if n > 0), DAEMON_OWNER)
        raise AccessDenied(
            "hashid",
            f"cannot unregister callable {hashid}: {who.owner} holds no reference to it "
            "(a client may drop only its own registrations; an admin may drop any)",
        )

    def drop_registration(self, owner: str, hashid: str) -> bool:
        """One reference of ``owner`` to ``hashid`` stops counting; False: it held none."""
        holders = self._registrations.get(hashid)
        if holders is None or holders[owner] <= 0:
            return False
        holders[owner] -= 1
        if holders[owner] <= 0:
            del holders[owner]
        if not holders:
            del self._registrations[hashid]
        self._uncount(owner, 1)
        return True

    def restore_registration(self, owner: str, hashid: str) -> None:
        """Undo :meth:`drop_registration`: the unregister it was for failed."""
        self._registrations.setdefault(hashid, Counter())[owner] += 1
        self._registration_count[owner] += 1

    def forget_registration(self, hashid: str) -> None:
        """The callable is gone from the registry: nobody holds a reference any more."""
        for owner, n in self._registrations.pop(hashid, Counter()).items():
            self._uncount(owner, n)

    # -- runs --------------------------------------------------------------------------

    @staticmethod
    def check_run(who: Identity, owner: str, run_id: int, what: str) -> None:
        """``AccessDenied`` naming the run unless ``who`` submitted it or is an admin."""
        if not (who.admin or owner == who.owner):
            raise AccessDenied("run_id", f"cannot {what} run {run_id}: {OWNED_BY_OTHER}")
