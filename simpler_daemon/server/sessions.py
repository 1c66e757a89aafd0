"""Client sessions: the registrations a client made, released when the client goes away.

A client registers callables inside a session it opened itself (a random id), held
open by one long-lived KeepSession call; when that call ends the session ends and
its references are released as UnregisterCallable would release them::

    client --KeepSession([id, renew, renew...])--> Sessions.open(who, id)   lease granted
    client --RegisterCallable(session=id)-------> Sessions.get(who, id)    one reference
                                                   per hashid per session (Session.refs)
    KeepSession ends: client closed / connection lost / process died / no renewal for
    limits.session_ttl --> Sessions.end(session) --> callables_rpc releases session.refs

A registration named ``persist`` (or without a session, or ``callables.preload``) is no
session's: it stays until unregistered. A session belongs to the identity that opened
it; another identity naming its id is refused. This module is the bookkeeping only (no
loop, no I/O): callables_rpc.py drives it on the daemon's event loop, so no locks.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from typing import Final

from simpler_daemon.errors import AccessDenied, InvalidField, LimitExceeded, Precondition
from simpler_daemon.server.peers import Identity

__all__ = ["SESSION_ID", "Session", "Sessions"]

#: What a client's session id may be: it appears in logs and refusals.
SESSION_ID: Final = re.compile(r"[0-9A-Za-z_-]{1,64}")


class Session:
    """One open client session: its owner and the references registered in it."""

    __slots__ = ("ended", "id", "opened_ns", "owner", "refs")

    def __init__(self, session_id: str, owner: str) -> None:
        self.id = session_id
        self.owner = owner
        #: When it opened (``time.time_ns()``, as ``RunRecord.submit_ns``): the owner's
        #: runs submitted since may use its callables.
        self.opened_ns = time.time_ns()
        #: hashid -> references this session holds (one, unless registrations of one
        #: path on different NEXT_LEVEL workers, or concurrent ones, each added one).
        self.refs: Counter[str] = Counter()
        self.ended = False

    def __repr__(self) -> str:
        return f"session {self.id} of {self.owner}"


def _check_id(session_id: str, what: str) -> None:
    if not SESSION_ID.fullmatch(session_id):
        shown = session_id[:64] + ("..." if len(session_id) > 64 else "")
        raise InvalidField(
            "session",
            f"cannot {what}: session id {shown!r} is not 1 to 64 characters of [0-9A-Za-z_-]",
        )


class Sessions:
    """Every open session by id, and how many references sessions hold per hashid."""

    def __init__(self) -> None:
        self._open: dict[str, Session] = {}
        self._per_owner: Counter[str] = Counter()
        self._held: Counter[str] = Counter()  # hashid -> references held by sessions

    def __len__(self) -> int:
        return len(self._open)

    def open(self, who: Identity, session_id: str, limit: int) -> Session:
        """A new session of ``who``. ``InvalidField`` for a malformed id,
        ``AccessDenied`` when another identity holds that id, ``Precondition`` when it
        is open already, ``LimitExceeded`` past limits.per_client_sessions."""
        _check_id(session_id, "open a session")
        held = self._open.get(session_id)
        if held is not None:
            if held.owner != who.owner:
                raise AccessDenied(
                    "session",
                    f"cannot open session {session_id}: it belongs to another client",
                )
            raise Precondition(
                "session",
                f"cannot open session {session_id}: it is open already (one KeepSession "
                "call holds a session)",
            )
        if self._per_owner[who.owner] >= limit:
            raise LimitExceeded(
                "session",
                f"cannot open session {session_id}: quota limits.per_client_sessions "
                f"({limit}) reached: {who.owner} holds {self._per_owner[who.owner]} open "
                "sessions (close some clients first)",
            )
        session = Session(session_id, who.owner)
        self._open[session_id] = session
        self._per_owner[who.owner] += 1
        return session

    def get(self, who: Identity, session_id: str, what: str) -> Session:
        """``who``'s open session ``session_id`` for ``what``. ``Precondition`` (field
        ``session``: the client opens a new session and retries) when it is not open,
        ``AccessDenied`` when it is another identity's."""
        _check_id(session_id, what)
        session = self._open.get(session_id)
        if session is None:
            raise Precondition(
                "session",
                f"cannot {what}: session {session_id} is not open (it ended with its "
                "KeepSession call; open a new one)",
            )
        if session.owner != who.owner:
            raise AccessDenied(
                "session", f"cannot {what}: session {session_id} belongs to another client"
            )
        return session

    def end(self, session: Session) -> None:
        """The session's KeepSession call ended: it takes no registration from now on;
        its ``refs`` are the caller's to release (each with :meth:`drop_ref`)."""
        if session.ended:
            return
        session.ended = True
        if self._open.get(session.id) is session:
            del self._open[session.id]
            left = self._per_owner[session.owner] - 1
            if left > 0:
                self._per_owner[session.owner] = left
            else:
                del self._per_owner[session.owner]

    # -- references ----------------------------------------------------------------------

    def add_ref(self, session: Session, hashid: str) -> None:
        session.refs[hashid] += 1
        self._held[hashid] += 1

    def drop_ref(self, session: Session, hashid: str) -> None:
        if session.refs[hashid] <= 0:
            session.refs.pop(hashid, None)
            return
        session.refs[hashid] -= 1
        if session.refs[hashid] <= 0:
            del session.refs[hashid]
        left = self._held[hashid] - 1
        if left > 0:
            self._held[hashid] = left
        else:
            self._held.pop(hashid, None)

    def held(self, hashid: str) -> int:
        """References to ``hashid`` that sessions (open or releasing) hold."""
        return self._held[hashid]

    def holder(self, owner: str, hashid: str, prefer: str, persistent: bool) -> Session | None:
        """The session whose reference to ``hashid`` an unregister by ``owner`` drops:
        ``prefer`` (the caller's own session) when it holds one; else None when
        ``owner`` holds a reference of no session (``persistent``); else any open
        session of ``owner`` holding one (None when there is none)."""
        session = self._open.get(prefer) if prefer else None
        if session is not None and session.owner == owner and session.refs[hashid] > 0:
            return session
        if persistent:
            return None
        for session in self._open.values():
            if session.owner == owner and session.refs[hashid] > 0:
                return session
        return None

    def held_by(self, owner: str, hashid: str) -> int:
        """References to ``hashid`` the open sessions of ``owner`` hold."""
        return sum(s.refs[hashid] for s in self._open.values() if s.owner == owner)

    def forget(self, hashid: str) -> None:
        """The callable is gone from the registry: no session holds it any more."""
        self._held.pop(hashid, None)
        for session in self._open.values():
            session.refs.pop(hashid, None)
