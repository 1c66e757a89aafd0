"""Local access: a local user with no special rights cannot hijack
the daemon's socket or its clients, a full /dev/shm is a start-up error (not a SIGBUS),
and ``map_buffer`` maps only the requested buffer from a heap file the client trusts.

Tests that need a second user create an unprivileged one (``useradd --system``) and
always remove it; they skip with a reason when not root.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from simpler_daemon import heap as heap_mod
from simpler_daemon.client import Client
from simpler_daemon.errors import StartupError, UntrustedPathError
from simpler_daemon.heap import Heap, heap_name
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.testing import poll_for
from tests.support.daemon_harness import REPO, DaemonProcess, NotifySocket, merged, write_config
from tests.support.users import User, throwaway_user

pytestmark = pytest.mark.timeout(120)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: creates a second user and mounts a tmpfs"
)


@pytest.fixture
def other_user() -> Iterator[User]:
    """A throw-away unprivileged user (the local attacker), removed afterwards."""
    with throwaway_user() as user:
        yield user


def run_as(user: User, code: str, *args: str) -> None:
    """Run ``code`` (stdlib Python) as ``user``, without root's groups."""
    subprocess.run(
        [
            "setpriv",
            f"--reuid={user.uid}",
            f"--regid={user.gid}",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            code,
            *args,
        ],
        check=True,
        capture_output=True,
        timeout=30,
        cwd="/",
    )


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (world-writable, sticky), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="simpler-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_MKDIR = "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], int(sys.argv[2], 8))"
_SYMLINK = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
_BIND = (
    "import os, socket, sys; os.mkdir(sys.argv[1], 0o755); "
    "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(sys.argv[1], 'daemon.sock'))"
)


def start_refused(daemon: DaemonProcess) -> str:
    """Start ``daemon`` expecting it to refuse; returns its stderr."""
    try:
        with pytest.raises(RuntimeError, match="exited with"):
            daemon.start(timeout=60)
    finally:
        with contextlib.suppress(Exception):
            daemon.stop(timeout=30)
        daemon.kill()
    return daemon.stderr()


# --------------------------------------------------------------------------- the daemon's socket


@needs_root
def test_daemon_refuses_a_runtime_dir_another_user_created(
    tmp_path: Path, shared_tmp: Path, other_user: User
) -> None:
    """The attacker pre-creates the daemon's runtime dir in a shared temp dir: the old
    daemon adopted it (and put its socket there, where the attacker can replace it)."""
    planted = shared_tmp / "simpler-daemon-0"
    run_as(other_user, _MKDIR, str(planted), "777")
    daemon = DaemonProcess(tmp_path / "d", {"daemon": {"runtime_dir": str(planted)}})
    err = start_refused(daemon)
    assert f"cannot use runtime directory {planted}" in err
    assert f"owned by uid {other_user.uid}" in err
    assert os.listdir(planted) == []  # no socket was handed to the attacker


@needs_root
def test_daemon_refuses_a_symlinked_runtime_dir(
    tmp_path: Path, shared_tmp: Path, other_user: User
) -> None:
    """A symlink planted at the runtime dir's name, to a directory the attacker owns."""
    target = shared_tmp / "attacker"
    run_as(other_user, _MKDIR, str(target), "777")
    link = shared_tmp / "simpler-daemon-0"
    run_as(other_user, _SYMLINK, str(target), str(link))
    daemon = DaemonProcess(tmp_path / "d", {"daemon": {"runtime_dir": str(link)}})
    err = start_refused(daemon)
    assert f"cannot use runtime directory {link}: {link} is a symlink owned by uid" in err
    assert os.listdir(target) == []


def test_daemon_refuses_its_own_runtime_dir_when_others_can_write_it(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    runtime.chmod(0o777)
    daemon = DaemonProcess(tmp_path / "d", {"daemon": {"runtime_dir": str(runtime)}})
    err = start_refused(daemon)
    assert f"cannot use runtime directory {runtime}" in err
    assert "writable by other users" in err


# A daemon whose relay loses the race between bind and chmod: right after the public
# socket is bound, "the attacker" replaces whatever is at the socket's path with a
# symlink to a root-owned 0600 file.
_SWAP_WRAPPER = """
import contextlib, os, sys
from simpler_daemon.server import peers

final, victim, config = sys.argv[1:4]
original = peers.UnixRelay.start

async def start(self):
    await original(self)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(final)
    os.symlink(victim, final)

peers.UnixRelay.start = start
from simpler_daemon.server.main import main
sys.exit(main(["serve", "--config", config]))
"""


def test_socket_mode_is_never_applied_through_a_swapped_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o750)
    (runtime / ".deadbeef").mkdir(mode=0o700)  # a staging dir a killed daemon left
    (runtime / ".deadbeef" / "s").write_text("")
    sock_path = runtime / "daemon.sock"
    config = write_config(
        tmp_path / "daemon.toml",
        merged({"daemon": {"runtime_dir": str(runtime)}, "workers": {"num_sub_workers": 1}}),
    )
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(_SWAP_WRAPPER)
    notify = NotifySocket(tmp_path / "notify.sock")
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, PYTHONPATH=str(REPO))
    env.pop("SIMPLER_DAEMON_SOCKET", None)
    with open(tmp_path / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(wrapper), str(sock_path), str(victim), str(config)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                return True
            return notify.seen("READY", "1")

        poll_for(ready, timeout=60, interval=0.02, message="daemon never sent READY=1")
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600  # never chmod-ed through the link
        st = os.lstat(sock_path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        with Client(str(sock_path)) as c:
            assert c.get_info().version
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        notify.close()
    assert sorted(os.listdir(runtime)) == []  # both sockets removed, staging dirs swept


# --------------------------------------------------------------------------- the clients' socket


@needs_root
def test_client_refuses_a_socket_another_user_planted(shared_tmp: Path, other_user: User) -> None:
    """The root client would have connected to the attacker's socket in /tmp."""
    planted = shared_tmp / "simpler-daemon-0"
    run_as(other_user, _BIND, str(planted))
    with pytest.raises(UntrustedPathError, match=f"owned by uid {other_user.uid}"):
        Client(str(planted / "daemon.sock"))


@needs_root
def test_client_refuses_a_socket_dir_reached_through_another_users_symlink(
    tmp_path: Path, shared_tmp: Path, other_user: User
) -> None:
    """The link points at a good directory now; its owner can repoint it at any time."""
    good = tmp_path / "run"
    good.mkdir(mode=0o755)
    link = shared_tmp / "simpler-daemon-0"
    run_as(other_user, _SYMLINK, str(good), str(link))
    with pytest.raises(UntrustedPathError, match=f"symlink owned by uid {other_user.uid}"):
        Client(str(link / "daemon.sock"))


def test_client_refuses_a_socket_in_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may replace the socket
    with pytest.raises(UntrustedPathError, match="writable by other users"):
        Client(str(shared / "daemon.sock"))


@needs_root
def test_client_refuses_a_heap_file_it_does_not_trust(tmp_path: Path, other_user: User) -> None:
    """``map_buffer`` opened any /dev/shm file the daemon named, whoever made it."""
    name = heap_name()
    path = Path(heap_mod.SHM_DIR) / name
    link_name = heap_name()
    link = Path(heap_mod.SHM_DIR) / link_name
    own = tmp_path / "own-heap"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, mmap.PAGESIZE)
        os.close(fd)
        os.chown(path, other_user.uid, other_user.gid)
        own.write_bytes(b"\0" * mmap.PAGESIZE)
        own.chmod(0o600)
        os.symlink(own, link)
        with Client(str(tmp_path / "daemon.sock"), timeout=5) as c:
            for heap, why in ((name, f"owned by uid {other_user.uid}"), (link_name, "")):
                info = pb.BufferInfo(
                    buffer_id=7, nbytes=64, shape=[16], dtype="float32", heap_name=heap
                )
                with pytest.raises(ValueError, match=f"cannot map buffer 7: .*{why}"):
                    c._view(info)
    finally:
        for p in (path, link):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


# --------------------------------------------------------------------------- a full /dev/shm


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 1 MiB tmpfs used as the heap directory (a nearly full /dev/shm)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(mnt)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        monkeypatch.setattr(heap_mod, "SHM_DIR", str(mnt))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def test_a_heap_larger_than_the_free_shm_space_is_a_clear_startup_error(
    small_shm: Path,
) -> None:
    """The old heap was sparse: creation succeeded and a later write would SIGBUS."""
    need = 4 << 20
    with pytest.raises(StartupError) as info:
        Heap(need, name=heap_name())
    message = str(info.value)
    assert message.startswith(f"cannot create the heap: {small_shm} has ")
    assert f"bytes free, the heap needs {need} bytes" in message
    assert os.listdir(small_shm) == []  # nothing left behind


def test_a_named_heap_is_reserved_in_full_at_creation(small_shm: Path) -> None:
    size = 512 << 10
    heap = Heap(size, name=heap_name())
    try:
        assert heap.path is not None
        st = os.stat(heap.path)
        assert st.st_blocks * 512 >= size  # every page backed now, not at first touch
        # The rest of the tmpfs is smaller than a second heap of the same size.
        with pytest.raises(StartupError, match="the heap needs"):
            Heap(size + mmap.PAGESIZE, name=heap_name())
    finally:
        heap.close()
    assert os.listdir(small_shm) == []


# --------------------------------------------------------------------------- map_buffer


def _mapped_bytes(name: str) -> int:
    """Bytes of this process's address space mapped from the /dev/shm file ``name``."""
    total = 0
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip().endswith("/" + name):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def test_map_buffer_maps_only_the_buffers_pages(tmp_path: Path) -> None:
    heap_bytes = 16 << 20
    daemon = DaemonProcess(tmp_path / "d", {"workers": {"heap_bytes": heap_bytes}})
    daemon.start()
    try:
        with daemon.client() as c:
            other = c.alloc_array(np.full(3000, 7, "int32"))
            buf = c.alloc_array(np.arange(1000, dtype="float32"))
            name = next(b.heap_name for b in c.list_buffers().buffers if b.buffer_id == buf)
            view = c.map_buffer(buf)
            assert view.tolist() == list(range(1000))
            mapped = _mapped_bytes(name)
            assert 0 < mapped <= 2 * mmap.PAGESIZE + 4000, mapped  # not the 16 MiB heap
            view[:] = -1  # still a shared, writable view of the daemon's bytes
            assert c.read_array(buf, (1000,), "float32").tolist() == [-1.0] * 1000
            assert c.read_array(other, (3000,), "int32").tolist() == [7] * 3000
            del view
    finally:
        daemon.stop()
