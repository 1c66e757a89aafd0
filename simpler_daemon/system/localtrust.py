"""Which local paths the daemon and its clients may trust.

A Unix socket or a ``/dev/shm`` heap is only as trustworthy as whoever could have
put it where it is. Two sides use the same rules:

* the daemon refuses a runtime directory it does not own, that others may write,
  or that is a symlink (``ensure_private_dir``), and binds its sockets inside a
  private directory so their mode and group are final before they are reachable
  (``staged_socket_path`` + ``publish_socket``);
* a client refuses a socket whose directory someone else could have prepared
  (``check_socket_path``) and a heap file not owned by itself, root or the
  daemon's uid (``open_trusted_heap``).

A directory is *trusted* when it is owned by a trusted uid and not writable by
group or others, except a sticky directory (``/tmp``): there nobody but an
entry's owner (or root) can replace the entry, so the entry below it only has to
be owned by a trusted uid itself.

Linux ignores ``fchmod``/``fchown`` on a socket descriptor for the bound path
(they change the socket inode, not the file), so mode and group are set by path while the file is still in the private staging
directory (nobody else can reach or replace it there); ``rename`` then publishes it
without following anything.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
from collections.abc import Collection, Iterator
from typing import Final

from simpler_daemon.errors import UntrustedPathError

__all__ = [
    "UntrustedPathError",
    "bind_private_listener",
    "check_directory",
    "check_socket_path",
    "ensure_private_dir",
    "open_trusted_heap",
    "publish_socket",
    "staged_socket_path",
    "sweep_staging_dirs",
    "trusted_dir_owner",
]

#: Mode bits that let someone other than the owner create, remove or rename entries.
_SHARED_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH
_MAX_UNIX_PATH: Final = 107
_STAGING_RE: Final = re.compile(r"^\.[0-9a-f]{8}$")


def bind_private_listener(path: str, backlog: int = 128) -> socket.socket:
    """A non-blocking listening Unix socket bound at ``path`` with mode 0600 (the umask
    is tightened around bind, so it is never world-accessible, not even for an
    instant); the caller chmods it to its configured mode before publishing it.
    ``OSError`` naming the path when it cannot be bound."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the Unix socket {path}: {exc}") from exc
    finally:
        os.umask(old_umask)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def _describe(st: os.stat_result) -> str:
    return f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_directory(path: str, st: os.stat_result, owners: Collection[int], what: str) -> None:
    """``UntrustedPathError`` unless ``st`` (of ``path``) is a directory owned by one of
    ``owners`` that neither group nor others may write."""
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(f"cannot use {what} {path}: it is not a directory")
    if st.st_uid not in owners:
        owner_list = ", ".join(str(u) for u in sorted(owners))
        raise UntrustedPathError(
            f"cannot use {what} {path}: it is {_describe(st)}; it must be owned by uid {owner_list}"
        )
    if st.st_mode & _SHARED_WRITE:
        raise UntrustedPathError(
            f"cannot use {what} {path}: it is {_describe(st)}, writable by other users"
        )


def _ancestors(path: str) -> Iterator[str]:
    """``/a/b/c`` -> ``/``, ``/a``, ``/a/b`` (the directories above ``path``)."""
    parts = [p for p in path.split("/") if p]
    yield "/"
    for i in range(1, len(parts)):
        yield "/" + "/".join(parts[:i])


def _check_chain(path: str, owners: Collection[int], *, allow_sticky: bool, what: str) -> None:
    """Every directory above ``path`` (resolved, so the checked chain is the one the
    kernel walks) is owned by one of ``owners``; a directory others may write is accepted
    only when sticky (and ``allow_sticky``), since each entry below it is checked too.
    A symlink on the way (``path`` itself included) must be owned by root or one of
    ``owners``: whoever owns a link can point it elsewhere after the check."""
    unresolved = os.path.abspath(path)
    for entry in [*_ancestors(unresolved), unresolved]:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(entry)
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in owners:
                raise UntrustedPathError(
                    f"cannot use {what} {path}: {entry} is a symlink owned by uid {st.st_uid}"
                )
    for parent in _ancestors(os.path.realpath(path)):
        st = os.stat(parent)
        if st.st_uid not in owners:
            raise UntrustedPathError(
                f"cannot use {what} {path}: its parent directory {parent} is {_describe(st)}"
            )
        if st.st_mode & _SHARED_WRITE and not (allow_sticky and st.st_mode & stat.S_ISVTX):
            raise UntrustedPathError(
                f"cannot use {what} {path}: its parent directory {parent} is {_describe(st)}, "
                "writable by other users"
            )


def ensure_private_dir(path: str, mode: int = 0o750, *, what: str = "directory") -> None:
    """Create ``path`` (mode ``mode``) or accept an existing one only when it is a real
    directory (not a symlink) owned by this process's user and not writable by group or
    others, in a chain of directories nobody else controls; ``UntrustedPathError``
    otherwise (the daemon never adopts a directory someone else prepared)."""
    me = os.geteuid()
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        # Missing parents are created as ours; the checks below still cover them.
        os.makedirs(parent, mode=0o755, exist_ok=True)
    _check_chain(path, {0, me}, allow_sticky=True, what=what)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)  # exclusive: an existing entry is verified, never reused blindly
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedPathError(f"cannot use {what} {path}: it is a symlink") from exc
        raise UntrustedPathError(f"cannot use {what} {path}: {exc.strerror or exc}") from exc
    try:
        check_directory(path, os.fstat(fd), {me}, what)
    finally:
        os.close(fd)


def trusted_dir_owner(directory: str, *, what: str = "socket directory") -> int:
    """The uid a client may trust for sockets in ``directory``; ``UntrustedPathError``
    when someone else could have prepared it.

    The client's own uid and root are always trusted. Another uid (a daemon running as
    its own service user) is trusted only when every directory above is root's (or the
    client's) and writable by nobody else: only an administrator could have created a
    directory there for that user, whereas anyone may create one in ``/tmp``."""
    me = os.geteuid()
    directory = os.path.abspath(directory)
    st = os.stat(directory)  # a symlinked /var/run is fine: the chain is checked resolved
    mine = {0, me}
    if st.st_uid in mine:
        _check_chain(directory, mine, allow_sticky=True, what=what)
        check_directory(directory, st, mine, what)
        return me
    try:
        _check_chain(directory, mine, allow_sticky=False, what=what)
    except UntrustedPathError as exc:
        raise UntrustedPathError(
            f"cannot use {what} {directory}: it is {_describe(st)} (neither root nor this "
            f"user) in a place other users may create it: {exc}"
        ) from exc
    check_directory(directory, st, {st.st_uid}, what)
    return st.st_uid


def _check_missing(directory: str, context: str) -> None:
    """``directory`` does not exist: its nearest existing ancestor must let nobody but
    root or this user create it (a sticky ``/tmp`` lets anyone create it first)."""
    me = os.geteuid()
    existing = directory
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    st = os.stat(existing)
    if st.st_uid not in (0, me) or st.st_mode & _SHARED_WRITE:
        raise UntrustedPathError(
            f"{context}: {directory} does not exist and {existing} ({_describe(st)}) lets "
            "other users create it first"
        )
    _check_chain(existing, {0, me}, allow_sticky=True, what="directory")


def check_socket_path(path: str) -> int:
    """Check a daemon socket before a client connects: its directory must be trusted
    (``trusted_dir_owner``) and the socket, if it exists already, a real socket owned by
    the client's user, root or the directory's trusted owner. Returns the uid whose heap
    files the client may map (the daemon's)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        owner = trusted_dir_owner(directory)
    except FileNotFoundError:
        # Not up yet: fine when only a trusted uid could create the directory later.
        _check_missing(directory, f"cannot connect to {path}")
        return os.geteuid()
    except UntrustedPathError as exc:
        raise UntrustedPathError(f"cannot connect to {path}: {exc}") from exc
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return owner  # not up yet; only a trusted uid can create it in that directory
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedPathError(f"cannot connect to {path}: it is not a socket")
    trusted = {0, os.geteuid(), owner}
    if st.st_uid not in trusted:
        raise UntrustedPathError(
            f"cannot connect to {path}: the socket is {_describe(st)}, not a uid the client "
            f"trusts ({', '.join(str(u) for u in sorted(trusted))})"
        )
    return st.st_uid if st.st_uid != 0 else owner


def open_trusted_heap(path: str, owners: Collection[int]) -> tuple[int, int]:
    """Open a heap file read-write without following a symlink; ``(fd, size)`` when it
    is a regular file owned by one of ``owners`` that group and others cannot write,
    ``UntrustedPathError`` otherwise (the caller closes ``fd``)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPathError(f"cannot map heap {path}: it is not a regular file")
        if st.st_uid not in owners or st.st_mode & _SHARED_WRITE:
            raise UntrustedPathError(
                f"cannot map heap {path}: it is {_describe(st)}; the client trusts only "
                f"uid {', '.join(str(u) for u in sorted(owners))} without group/other write"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


@contextlib.contextmanager
def staged_socket_path(path: str) -> Iterator[str]:
    """A path to bind ``path``'s socket at first: inside a fresh private (0700) directory
    next to ``path`` (same file system, so ``publish_socket`` can rename it into place).
    The directory (and the staged file, if still there) is removed on exit."""
    directory = os.path.dirname(os.path.abspath(path))
    staging = os.path.join(directory, f".{secrets.token_hex(4)}")
    staged = os.path.join(staging, "s")
    if len(os.fsencode(staged)) > _MAX_UNIX_PATH or len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise OSError(f"cannot bind {path}: the path is too long for a Unix socket")
    try:
        os.mkdir(staging, 0o700)
    except OSError as exc:
        raise OSError(f"cannot bind {path}: cannot create {staging}: {exc.strerror}") from exc
    try:
        yield staged
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        with contextlib.suppress(OSError):
            os.rmdir(staging)


def sweep_staging_dirs(directory: str) -> list[str]:
    """Remove staging directories (``.<8 hex>``, ours) a killed daemon left in
    ``directory``; returns their paths. Call only on a verified private directory."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if not _STAGING_RE.match(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            with contextlib.suppress(OSError):
                for name in os.listdir(entry.path):
                    os.unlink(os.path.join(entry.path, name))
                os.rmdir(entry.path)
                removed.append(entry.path)
    return removed


def publish_socket(staged: str, path: str, mode: int, gid: int | None) -> None:
    """Give the socket bound at ``staged`` its ``mode`` and group ``gid``, then rename it
    over ``path``: nobody can reach or swap the staged file (its directory is ours, 0700),
    and ``rename`` replaces a symlink planted at ``path`` instead of following it.
    Raises ``OSError`` naming ``path``."""
    try:
        if not stat.S_ISSOCK(os.lstat(staged).st_mode):
            raise OSError(f"{staged} is not a socket")
        os.chmod(staged, mode)
        if gid is not None:
            os.chown(staged, -1, gid, follow_symlinks=False)
        os.rename(staged, path)
    except OSError as exc:
        raise OSError(f"cannot publish the Unix socket {path}: {exc.strerror or exc}") from exc
