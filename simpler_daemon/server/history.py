"""The run history: runs and id counters kept across restarts in an SQLite file.

::

    start-up (Daemon.prepare, one thread, after the forks)
      History.open(state_dir)  flock <state_dir>/lock (a second daemon fails here)
                               runs.sqlite3: WAL, quick_check, schema_version
                               runs recorded active -> LOST ("the daemon stopped (pid N) ...")
                               load the runs (RunTable.restore), reserve a block of ids

    event loop                                        writer thread (the only writer)
      RunTable: submitted / changed / forget(run)
        -> _pending {run_id: record | None}
        _flush (FLUSH_DELAY later, on the loop):
           rows = record.history_row() ...   --SimpleQueue-->  one transaction per batch
      every COUNTS_PERIOD: live runs whose                     (sqlite3.Error: logged once
        state or counts moved -> _pending                       per incident, counted in
      IdBlock.__next__ (run ids, buffer ids)                    history_write_failures,
        past half its block -> reserve ahead  --------------->  the rows kept and retried)

A run submitted and finished within FLUSH_DELAY is written once. Ids: every id
below a counter's stored ceiling may have been handed out; the daemon reserves the
next ``ID_BLOCK`` durably before it gets there, so after a crash (SIGKILL) ids resume
at the ceiling and never repeat; a clean stop stores the exact next id. Recording never
fails a run: a full disk or an I/O error is logged and counted, and the daemon keeps
serving from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from typing import Any, Final, NamedTuple

import msgspec

from simpler_daemon.errors import StartupError, UnknownObject
from simpler_daemon.protocol._proto.simpler.daemon.v1 import daemon_pb2 as pb
from simpler_daemon.scheduler.runmodel import Run
from simpler_daemon.system.runtimedir import MEMORY_STATE

__all__ = [
    "COUNTS_PERIOD",
    "DB_NAME",
    "FLUSH_DELAY",
    "ID_BLOCK",
    "LOCK_NAME",
    "SCHEMA_VERSION",
    "History",
    "IdBlock",
    "StoredRun",
    "UnrecordedRun",
    "open_history",
]

log = logging.getLogger("simpler_daemon.history")

DB_NAME: Final = "runs.sqlite3"
LOCK_NAME: Final = "lock"
SCHEMA_VERSION: Final = 1
#: Ids reserved durably ahead of the ones handed out.
ID_BLOCK: Final = 1000
#: Seconds between a change and its write: what happens meanwhile is written once.
FLUSH_DELAY: Final = 0.02
#: Seconds between two recordings of an active run's state and counts.
COUNTS_PERIOD: Final = 0.5
#: Milliseconds SQLite waits for a lock before it says "database is locked".
BUSY_TIMEOUT_MS: Final = 200
#: Seconds the loop waits for a reservation when it caught up with its ceiling.
_RESERVE_WAIT: Final = 5.0
#: Rows kept for a retry while writes fail (a full disk); older ones are dropped.
_RETRY_ROWS: Final = 20_000
_TERMINAL: Final = frozenset(
    {pb.RUN_STATE_COMPLETED, pb.RUN_STATE_FAILED, pb.RUN_STATE_CANCELLED, pb.RUN_STATE_LOST}
)

_SCHEMA: Final = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, ceiling INTEGER NOT NULL);
CREATE TABLE runs (
    run_id INTEGER PRIMARY KEY,
    client TEXT NOT NULL,
    label TEXT NOT NULL,
    key TEXT NOT NULL,
    key_print BLOB NOT NULL,
    priority INTEGER NOT NULL,
    state INTEGER NOT NULL,
    total INTEGER NOT NULL,
    done INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    running INTEGER NOT NULL,
    submit_ns INTEGER NOT NULL,
    finish_ns INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    message TEXT NOT NULL,
    error BLOB,
    results BLOB,
    results_dropped TEXT NOT NULL,
    updated_ns INTEGER NOT NULL,
    pid INTEGER NOT NULL
);
"""
_COLUMNS: Final = (
    "run_id, client, label, key, key_print, priority, state, total, done, failed, running, "
    "submit_ns, finish_ns, seq, message, error, results, results_dropped, updated_ns, pid"
)
_UPSERT: Final = f"INSERT OR REPLACE INTO runs ({_COLUMNS}) VALUES ({', '.join('?' * 20)})"

_encode_results = msgspec.msgpack.Encoder().encode
_decode_results = msgspec.msgpack.Decoder(list[tuple[int, int | None, bytes]]).decode


class StoredRun(NamedTuple):
    """One run as the history holds it (``RunRecord.restored`` turns it into a record)."""

    run_id: int
    client: str
    label: str
    key: str
    key_print: bytes
    priority: int
    state: int
    total: int
    done: int
    failed: int
    running: int
    submit_ns: int
    finish_ns: int
    seq: int
    message: str
    #: A serialized ``RunError`` (None: no error).
    error: bytes | None
    #: The encoded task results (task index, member index, msgpack value); None: none kept.
    results: list[tuple[int, int | None, bytes]] | None
    results_dropped: str


#: What RunRecord.history_row() returns: StoredRun's fields with the results still a
#: list (encoded on the writer thread), then updated_ns and the daemon's pid.
Row = tuple[Any, ...]


class IdBlock:
    """Ids handed out in order (an iterator: ``next(block)``), reserved durably ahead.

    ``durable`` is the stored ceiling: no id at or above it was handed out before it
    was stored. Past half a block the writer is asked to store the next one; if the
    loop gets to the ceiling first it waits for that write (``_RESERVE_WAIT`` at most).
    Safe to call from any thread (an orchestration function runs on one).
    """

    __slots__ = ("_asked", "_history", "_lock", "_next", "durable", "name")

    def __init__(self, name: str, history: History | None) -> None:
        self.name = name
        self._next = 1
        self.durable = 1
        self._asked = 1
        self._history = history
        self._lock = threading.Lock()

    def __iter__(self) -> IdBlock:
        return self

    def __next__(self) -> int:
        with self._lock:
            n = self._next
            self._next = n + 1
            history = self._history
            if history is not None and n + ID_BLOCK // 2 >= self.durable:
                if self._asked <= self.durable:  # no block past this one asked for yet
                    self._asked = n + ID_BLOCK
                    history.reserve(self, self._asked, wait=False)
                if n >= self.durable:  # caught up with the stored ceiling: wait for one past n
                    self._asked = max(self._asked, n + ID_BLOCK)
                    history.reserve(self, self._asked, wait=True)
            return n

    @property
    def next_id(self) -> int:
        """The id the next ``next()`` returns."""
        return self._next

    def detach(self) -> None:
        """Count on without storing anything (the history is closed)."""
        self._history = None


def _corrupt_text(path: str, why: str) -> str:
    return (
        f"cannot open the run history {path}: {why}; start with --reset-state to move it "
        "aside and begin an empty history (or set daemon.state_dir elsewhere)"
    )


def _lock(directory: str) -> int:
    """Hold ``<directory>/lock`` exclusively for this process (flock; released when the
    process ends, however it ends). ``StartupError`` naming the holder when taken."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StartupError(
            f"cannot open the run history in {directory}: cannot open {path}: {exc.strerror or exc}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = os.pread(fd, 32, 0).decode().strip()
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StartupError(
                f"cannot lock the run history {path}: {exc.strerror or exc}"
            ) from exc
        who = f"another daemon (pid {holder})" if holder.isdigit() else "another daemon"
        raise StartupError(
            f"cannot open the run history in {directory}: {who} is using it ({path} is "
            "locked); stop that daemon or give this one another daemon.state_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _connect(path: str) -> sqlite3.Connection:
    """Open and check the database; ``sqlite3.DatabaseError`` when it is unusable."""
    with contextlib.suppress(FileExistsError):  # the runs' labels and results: owner only
        # (SQLite gives its -wal and -shm files the database's mode).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.DatabaseError(f"cannot use write-ahead logging (journal mode {mode})")
        # FULL: a committed id reservation survives a power loss too (one fsync per
        # batch, on the writer thread).
        db.execute("PRAGMA synchronous = FULL")
        check = db.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            text = "; ".join(str(r[0]) for r in check[:3])
            raise sqlite3.DatabaseError(f"the integrity check failed: {text}")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables:
            db.executescript(
                f"BEGIN IMMEDIATE;\n{_SCHEMA}\n"
                f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION});\nCOMMIT;"
            )
        elif not {"schema_version", "counters", "runs"} <= tables:
            raise sqlite3.DatabaseError(
                f"it is not a run history (tables: {', '.join(sorted(tables))})"
            )
        else:
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None or row[0] != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"schema version {row[0] if row else 'missing'}, this daemon reads "
                    f"version {SCHEMA_VERSION}"
                )
    except BaseException:
        db.close()
        raise
    return db


def _salvage_ceilings(path: str) -> dict[str, int]:
    """The id ceilings a database that cannot be opened may still give (--reset-state
    keeps ids from repeating when it can)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT name, ceiling FROM counters").fetchall()
            top = db.execute("SELECT max(run_id) FROM runs").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return {}
    out = {str(n): int(c) for n, c in rows}
    if top and top[0]:
        out["run"] = max(out.get("run", 1), int(top[0]) + 1)
    return out


def _move_aside(path: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{path}.corrupt-{stamp}"
    os.rename(path, aside)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.rename(path + suffix, aside + suffix)
    return aside


class UnrecordedRun(UnknownObject):
    """A run id the previous daemon may have handed out but never recorded (it was
    killed within ``FLUSH_DELAY`` of the submit): if it was submitted, it is LOST."""

    def __init__(self, field: str, run_id: int) -> None:
        self.run_id = run_id
        self.text = (
            f"run {run_id} has no record: the daemon that handed out its id was stopped "
            "before it recorded the run; if it was submitted, it is LOST"
        )
        super().__init__(field, self.text)

    def status(self) -> Any:
        """What WaitRun answers for it: LOST, with nothing else known."""
        error = pb.RunError(message=self.text, outcome="LOST")
        return pb.RunStatus(run_id=self.run_id, state=pb.RUN_STATE_LOST, error=error)


class History:
    """The run history of one daemon; see the module docstring.

    Opened in ``Daemon.prepare`` (``open``: start-up errors), started on the loop
    (``start``: the writer thread), closed once the runs are settled (``close``).
    """

    def __init__(self, directory: str, db: sqlite3.Connection, lock_fd: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, DB_NAME)
        self._db = db
        self._lock_fd = lock_fd
        self._pid = os.getpid()
        #: The runs found at open, oldest first (RunTable.restore takes them).
        self.stored: list[StoredRun] = []
        #: How many of them were active when their daemon stopped (now LOST).
        self.lost = 0
        #: ``[lo, hi)`` ranges of run ids killed daemons may have handed out unrecorded.
        self._unrecorded: list[tuple[int, int]] = []
        self.run_ids = IdBlock("run", self)
        self.buffer_ids = IdBlock("buffer", self)
        #: Set by the run table: history_write_failures is counted there.
        self.metrics: Any = None
        #: Writes (batches) that failed, and whether the last one did.
        self.failures = 0
        self.failing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, Any] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        self._live: dict[int, tuple[Any, tuple[int, int, int, int]]] = {}
        self._counts_handle: asyncio.TimerHandle | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._retry: dict[int, Row | None] = {}

    # -- opening (one thread, before serving) ---------------------------------------------

    @classmethod
    def open(cls, directory: str, *, reset: bool = False) -> History:
        """Lock ``directory``, open (or create) its database, turn runs that were active
        into LOST ones and reserve the first block of ids.

        Raises ``StartupError`` naming the path when the directory cannot be used,
        another daemon holds it, or the database is corrupt or not a run history
        (``reset``: such a database is moved aside to ``runs.sqlite3.corrupt-<time>``
        and an empty one is started).
        """
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"cannot create the run history directory {directory} (daemon.state_dir): "
                f"{exc.strerror or exc}"
            ) from exc
        lock_fd = _lock(directory)
        try:
            path = os.path.join(directory, DB_NAME)
            ceilings: dict[str, int] = {}
            try:
                db = _connect(path)
            except sqlite3.DatabaseError as exc:  # OperationalError too: locked, unreadable
                if not reset or not os.path.lexists(path):  # nothing there to move aside
                    raise StartupError(_corrupt_text(path, str(exc))) from exc
                ceilings = _salvage_ceilings(path)
                aside = _move_aside(path)
                log.warning(
                    "run history %s could not be opened (%s): moved aside to %s (--reset-state); "
                    "starting an empty history%s",
                    path,
                    exc,
                    aside,
                    "" if ceilings else "; its id counters were unreadable: ids restart at 1",
                )
                try:
                    db = _connect(path)
                except sqlite3.DatabaseError as again:
                    raise StartupError(_corrupt_text(path, str(again))) from again
            history = cls(directory, db, lock_fd)
            try:
                history._load(ceilings)
            except sqlite3.DatabaseError as exc:
                db.close()
                raise StartupError(_corrupt_text(path, str(exc))) from exc
        except BaseException:
            os.close(lock_fd)
            raise
        return history

    def _load(self, salvaged: dict[str, int]) -> None:
        db = self._db
        now = time.time_ns()
        db.execute("BEGIN IMMEDIATE")
        try:
            active = db.execute(
                "SELECT run_id, pid, updated_ns FROM runs WHERE state NOT IN (?, ?, ?, ?)",
                tuple(_TERMINAL),
            ).fetchall()
            for run_id, pid, updated_ns in active:
                text = f"the daemon stopped (pid {pid}) while run {run_id} was active"
                error = pb.RunError(message=text, outcome="LOST").SerializeToString()
                db.execute(
                    "UPDATE runs SET state = ?, running = 0, message = ?, error = ?, "
                    "finish_ns = ? WHERE run_id = ?",
                    (pb.RUN_STATE_LOST, text, error, updated_ns or now, run_id),
                )
            ceilings = dict(salvaged)
            for name, ceiling in db.execute("SELECT name, ceiling FROM counters"):
                ceilings[name] = max(ceilings.get(name, 1), int(ceiling))
            top = db.execute("SELECT max(run_id) FROM runs").fetchone()[0]
            if top:
                ceilings["run"] = max(ceilings.get("run", 1), int(top) + 1)
            # Ids between the last recorded run and the ceiling may have been handed out
            # by a daemon killed before it recorded them (within FLUSH_DELAY): kept as a
            # counters row "unrecorded:LO" = HI, one per crash, read back every start.
            lo, hi = int(top or 0) + 1, max(1, ceilings.get("run", 1))
            if lo < hi:
                db.execute(
                    "INSERT OR REPLACE INTO counters VALUES (?, ?)", (f"unrecorded:{lo}", hi)
                )
            self._unrecorded = [
                (int(name.partition(":")[2]), int(ceiling))
                for name, ceiling in db.execute(
                    "SELECT name, ceiling FROM counters WHERE name LIKE 'unrecorded:%'"
                )
            ]
            for block in (self.run_ids, self.buffer_ids):
                first = max(1, ceilings.get(block.name, 1))
                block._next = first
                block.durable = block._asked = first + ID_BLOCK
                db.execute(
                    "INSERT OR REPLACE INTO counters VALUES (?, ?)", (block.name, block.durable)
                )
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        self.lost = len(active)
        rows = db.execute(
            "SELECT run_id, client, label, key, key_print, priority, state, total, done, "
            "failed, running, submit_ns, finish_ns, seq, message, error, results, "
            "results_dropped FROM runs ORDER BY run_id"
        ).fetchall()
        stored = []
        for row in rows:
            fields = list(row)
            blob = fields[16]
            try:
                fields[16] = None if blob is None else _decode_results(blob)
            except msgspec.DecodeError:
                fields[16] = None
                fields[17] = "the stored results could not be decoded"
            stored.append(StoredRun(*fields))
        self.stored = stored

    # -- the loop side --------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the writer thread; record from ``loop`` (the running one) from now on."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._writer, name="history-writer", daemon=True)
        self._thread.start()
        if self._pending:
            self._arm()

    def restored(self, kept: int) -> None:
        """The run table took the stored runs: ``kept`` of them within its limits."""
        if kept or self.lost:
            log.info(
                "run history %s: %d earlier runs known (%d came back LOST: active when "
                "their daemon stopped)",
                self.path,
                kept,
                self.lost,
            )

    def submitted(self, rec: Any) -> None:
        """A run was launched (or changed: its results were dropped, it finished)."""
        run_id = rec.run_id
        if self._closed or not run_id:
            return
        self._pending[run_id] = rec
        if rec.terminal:
            self._live.pop(run_id, None)
        elif run_id not in self._live:
            self._live[run_id] = (rec, (-1, -1, -1, -1))
            if self._counts_handle is None and self._loop is not None:
                self._counts_handle = self._loop.call_later(COUNTS_PERIOD, self._counts)
        self._arm()

    changed = submitted
    finished = submitted

    def unrecorded(self, run_id: int, field: str) -> UnrecordedRun | None:
        """:class:`UnrecordedRun` for an id the previous daemon may have handed out
        unrecorded, else None."""
        if any(lo <= run_id < hi for lo, hi in self._unrecorded):
            return UnrecordedRun(field, run_id)
        return None

    def forget(self, run_id: int) -> None:
        """Retention dropped the run: delete it from the history too."""
        if self._closed:
            return
        self._live.pop(run_id, None)
        self._pending[run_id] = None
        self._arm()

    def _arm(self) -> None:
        if self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_later(FLUSH_DELAY, self._flush)

    def _counts(self) -> None:
        """Record the active runs whose state or counts moved since last time."""
        self._counts_handle = None
        for run_id, (rec, last) in list(self._live.items()):
            if rec.terminal:
                continue  # its finish is pending already
            now = (rec.proto_state(), rec.done, rec.failed, rec.total)
            if now != last:
                self._live[run_id] = (rec, now)
                self._pending[run_id] = rec
        if self._pending:
            self._arm()
        if self._live and not self._closed and self._loop is not None:
            self._counts_handle = self._loop.call_later(COUNTS_PERIOD, self._counts)

    def _flush(self) -> None:
        """On the loop: snapshot the pending runs and hand the rows to the writer."""
        self._flush_handle = None
        pending, self._pending = self._pending, {}
        if not pending:
            return
        rows: dict[int, Row | None] = {}
        for run_id, rec in pending.items():
            if rec is None:
                rows[run_id] = None
                continue
            try:
                rows[run_id] = rec.history_row(self._pid)
            except Exception:  # never into the caller: recording must not fail a run
                log.exception("run %d: cannot snapshot it for the run history", run_id)
        self._queue.put(("rows", rows))

    def reserve(self, block: IdBlock, ceiling: int, *, wait: bool) -> None:
        """Store ``ceiling`` for ``block`` (on the writer); ``wait``: until it is stored."""
        if self._closed:
            return  # close() stores the exact next ids
        if self._thread is None:  # not serving yet (start-up): store it here and now
            self._store_ceiling(block, ceiling)
            return
        done = threading.Event() if wait else None
        self._queue.put(("reserve", (block, ceiling, done)))
        if done is not None and not done.wait(_RESERVE_WAIT):
            log.error(
                "run history %s: reserving %s ids up to %d took over %.0fs; handing out "
                "%s id %d anyway (after a crash it may be given again)",
                self.path,
                block.name,
                ceiling,
                _RESERVE_WAIT,
                block.name,
                block.next_id - 1,
            )

    def _store_ceiling(self, block: IdBlock, ceiling: int) -> None:
        try:
            self._db.execute(
                "UPDATE counters SET ceiling = max(ceiling, ?) WHERE name = ?",
                (ceiling, block.name),
            )
        except sqlite3.Error as exc:
            self._failed(exc, f"reserving {block.name} ids")
            return
        block.durable = max(block.durable, ceiling)

    async def close(self) -> None:
        """Write what is pending, stop the writer, store the exact next ids, unlock."""
        if self._closed:
            return
        for handle in (self._flush_handle, self._counts_handle):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._counts_handle = None
        # Runs still active now are recorded as they are: the next start reports them LOST.
        for run_id, (rec, _) in self._live.items():
            self._pending.setdefault(run_id, rec)
        self._flush()
        self._closed = True
        self._queue.put(("stop", None))
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)
        else:  # never started (start-up failed): write here
            self._writer()
        self._finish()

    def _finish(self) -> None:
        db = self._db
        if db is None:
            return
        try:
            for block in (self.run_ids, self.buffer_ids):
                block.detach()
                db.execute(
                    "UPDATE counters SET ceiling = ? WHERE name = ?", (block.next_id, block.name)
                )
        except sqlite3.Error as exc:
            self._failed(exc, "storing the id counters")
        finally:
            for block in (self.run_ids, self.buffer_ids):
                block.detach()
            with contextlib.suppress(sqlite3.Error):
                db.close()
            self._db = None  # type: ignore[assignment]
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)

    # -- the writer thread ----------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0 if self._retry else None)
            except queue.Empty:
                self._write_rows({})  # retry what failed
                continue
            kind, payload = item
            if kind == "stop":
                while True:  # anything queued before the stop
                    try:
                        kind, payload = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    self._handle(kind, payload)
                if self._retry:
                    self._write_rows({})
                return
            self._handle(kind, payload)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "rows":
            self._write_rows(payload)
        elif kind == "reserve":
            block, ceiling, done = payload
            self._store_ceiling(block, ceiling)
            if done is not None:
                done.set()

    def _write_rows(self, rows: dict[int, Row | None]) -> None:
        if self._retry:
            retry, self._retry = self._retry, {}
            retry.update(rows)
            rows = retry
        if not rows:
            return
        upserts = []
        deletes = []
        for run_id, row in rows.items():
            if row is None:
                deletes.append((run_id,))
                continue
            results = row[16]
            blob = None if results is None else _encode_results(results)
            upserts.append((*row[:16], blob, *row[17:]))
        db = self._db
        try:
            db.execute("BEGIN")
            if upserts:
                db.executemany(_UPSERT, upserts)
            if deletes:
                db.executemany("DELETE FROM runs WHERE run_id = ?", deletes)
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            self._failed(exc, f"recording {len(rows)} runs")
            if len(rows) > _RETRY_ROWS:  # keep the newest (run ids grow)
                rows = dict(sorted(rows.items())[-_RETRY_ROWS:])
            self._retry = rows
            return
        if self.failing:
            self.failing = False
            log.warning("run history %s: recording works again", self.path)

    def _failed(self, exc: Exception, what: str) -> None:
        """A write failed: count it; log it loudly the first time of an incident."""
        self.failures += 1
        metrics = self.metrics
        if metrics is not None:
            metrics.history_write_failed()
        if not self.failing:
            self.failing = True
            log.error(
                "cannot record the run history in %s (%s): %s: %s; runs go on, their "
                "history is kept in memory and written again once this clears",
                self.path,
                what,
                type(exc).__name__,
                exc,
            )


def open_history(state_dir: str, heap: Any, *, reset: bool = False) -> History | None:
    """The daemon's run history in ``state_dir`` (None for ``":memory:"``), whose ids the
    engine's runs and ``heap``'s buffers take from now on. ``StartupError`` as
    :meth:`History.open` raises it."""
    if state_dir == MEMORY_STATE:
        return None
    history = History.open(state_dir, reset=reset)
    Run.continue_ids(history.run_ids)
    heap.continue_ids(history.buffer_ids)
    log.info(
        "run history %s: %d runs kept, next run id %d, next buffer id %d",
        history.path,
        len(history.stored),
        history.run_ids.next_id,
        history.buffer_ids.next_id,
    )
    return history
