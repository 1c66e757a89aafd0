"""Operator log lines: one record per event an operator acts on.

Each function emits exactly one record on the ``simpler_daemon.ops`` logger: failures
at WARNING, cancels at INFO, a successful run at DEBUG (a busy daemon finishes
thousands a second; nobody alerts on those). The message reads on its own in the text
format; the same fields travel as ``extra`` so the JSON format carries them as keys
(``event``, ``run_id``, ``client``, ...), e.g.::

    {"level": "warning", "logger": "simpler_daemon.ops", "event": "task_failed",
     "message": "task 2 of run 7 failed on sub worker 0 (pid 4242, hashid 3f2a...):
                 TASK_FAILURE: ValueError: boom", "run_id": 7, "task_index": 2, ...}

The extra keys never collide with the formatter's own (``pid`` is the logging
process; a worker's pid is ``worker_pid``).
"""

from __future__ import annotations

import logging
from typing import Any, Final

__all__ = [
    "LOGGER_NAME",
    "heap_exhausted",
    "register_refused",
    "run_cancelled",
    "run_finished",
    "task_failed",
]

LOGGER_NAME: Final = "simpler_daemon.ops"

log = logging.getLogger(LOGGER_NAME)

#: Longest error text copied into one record; a traceback is summarised, not pasted.
_MAX_TEXT: Final = 2000


def _text(value: object) -> str:
    text = str(value)
    if len(text) > _MAX_TEXT:
        return text[:_MAX_TEXT] + f" ... ({len(text)} chars)"
    return text


def _first_line(value: object) -> str:
    lines = str(value).strip().splitlines()
    first = _text(lines[0]) if lines else ""
    return first + (f" (+{len(lines) - 1} lines)" if len(lines) > 1 else "")


def _emit(level: int, event: str, message: str, fields: dict[str, Any]) -> None:
    if log.isEnabledFor(level):
        log.log(level, "%s", message, extra={"event": event, **fields})


def _state_name(state: object) -> str:
    """``"FAILED"``, ``"RUN_STATE_FAILED"``, ``RunPhase.FAILED`` -> ``"failed"``."""
    name = getattr(state, "name", None)
    text = name if isinstance(name, str) else str(state)
    return text.rsplit(".", 1)[-1].removeprefix("RUN_STATE_").lower()


def _who(client: str, label: str = "") -> str:
    return f"client {client or '?'}" + (f", label {label!r}" if label else "")


def run_finished(
    run_id: int, client: str, label: str, state: object, error_message: str | None
) -> None:
    """A run reached a terminal state: WARNING when it failed, INFO when cancelled,
    DEBUG when it completed. ``state`` is a name (``"failed"``, ``"RUN_STATE_FAILED"``)
    or an enum member."""
    name = _state_name(state)
    level = {"failed": logging.WARNING, "cancelled": logging.INFO}.get(name, logging.DEBUG)
    message = f"run {run_id} {name} ({_who(client, label)})"
    if error_message:
        # One line in the text format (journald makes every line an entry): the first
        # line of the error here, the whole text in the record's ``error`` field.
        # The engine's error text starts with "run N failed: " already.
        summary = _first_line(error_message).removeprefix(f"run {run_id} {name}: ")
        message += f": {summary}"
    _emit(
        level,
        "run_finished",
        message,
        {
            "run_id": run_id,
            "client": client,
            "label": label,
            "state": name,
            "error": _text(error_message) if error_message else "",
        },
    )


def task_failed(
    run_id: int,
    task_index: int,
    worker: object,
    pid: int | None,
    hashid: str,
    first_line: str,
    outcome: object,
) -> None:
    """One task failed (WARNING): where it ran (worker label or id, pid), what it ran
    (hashid) and the first line of its error; ``outcome`` is ``TASK_FAILURE``,
    ``ENDPOINT_FAILURE``, ``DEADLINE_EXCEEDED``... (a name or an enum member)."""
    outcome_name = getattr(outcome, "name", None) or str(outcome)
    where = str(worker) if not isinstance(worker, int) else f"worker {worker}"
    details = ", ".join(
        part for part in (f"pid {pid}" if pid else "", f"hashid {hashid}" if hashid else "") if part
    )
    message = f"task {task_index} of run {run_id} failed on {where}"
    if details:
        message += f" ({details})"
    message += f": {outcome_name}: {_first_line(first_line)}"
    _emit(
        logging.WARNING,
        "task_failed",
        message,
        {
            "run_id": run_id,
            "task_index": task_index,
            "worker": where,
            "worker_pid": pid,
            "hashid": hashid,
            "error": _text(first_line),
            "outcome": outcome_name,
        },
    )


def run_cancelled(run_id: int, client: str, reason: str, terminate: bool) -> None:
    """A client (or the daemon) cancelled a run (INFO); ``terminate``: its running tasks
    were stopped too."""
    how = "cancelled (terminate: running tasks stopped)" if terminate else "cancelled"
    message = f"run {run_id} {how} by {_who(client)}"
    if reason:
        message += f": {_text(reason)}"
    _emit(
        logging.INFO,
        "run_cancelled",
        message,
        {"run_id": run_id, "client": client, "reason": _text(reason), "terminate": terminate},
    )


def register_refused(import_path: str, client: str, reason: str) -> None:
    """A RegisterCallable was refused (WARNING): not allowed, not importable, failed in
    the children."""
    _emit(
        logging.WARNING,
        "register_refused",
        f"cannot register {_text(import_path)} for {_who(client)}: {_text(reason)}",
        {"import_path": _text(import_path), "client": client, "reason": _text(reason)},
    )


def heap_exhausted(client: str, nbytes: int, reason: str) -> None:
    """An allocation was refused for want of heap or quota (WARNING)."""
    _emit(
        logging.WARNING,
        "heap_exhausted",
        f"cannot allocate {nbytes} bytes for {_who(client)}: {_text(reason)}",
        {"client": client, "nbytes": nbytes, "reason": _text(reason)},
    )
