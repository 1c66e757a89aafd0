"""Which failed attempts of a task run again (``CallConfig.max_retries``), and the text
each one leaves in the task's error.

The policy's vocabulary (``retry_on``, ``retry_exceptions``, validation) is
``simpler_daemon/retrypolicy.py``; :mod:`simpler_daemon.scheduler.completion` applies
it: a retried single task goes back to the head of its queue (READY again), a retried
group member waits in ``SchedulerState.member_retries`` for a lane (its SUB pool's, or
its own NEXT_LEVEL target) while the other members keep their results. A dead lane is
replaced by the usual path first, so a retry after a crash runs on a live worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from simpler_daemon.endpoints.base import Outcome
from simpler_daemon.mailbox.layout import (
    ERR_BAD_ARGS,
    ERR_CANCELLED,
    ERR_DEADLINE,
    ERR_NOT_REGISTERED,
    ERR_RESULT,
    ERR_SHUTDOWN,
    ERR_TASK,
)
from simpler_daemon.retrypolicy import matches

if TYPE_CHECKING:
    from simpler_daemon.args import CallConfig
    from simpler_daemon.scheduler.lanes import WorkerCompletion

__all__ = ["MAX_CAUSE_CHARS", "attempt_text", "failure_cause", "retry_cause"]

#: How much of one attempt's error text its cause line keeps (the last attempt's whole
#: text is the task's error as before).
MAX_CAUSE_CHARS: Final = 300


def failure_cause(outcome: Outcome, error: int) -> str:
    """What made an attempt fail: ``crash``, ``deadline``, ``exception`` (the causes
    ``retry_on`` names) or what is never retried (``bad args``, ``not registered``,
    ``result``, ``shutdown``, ``cancelled``, ``failure``)."""
    if error == ERR_DEADLINE:
        return "deadline"
    if outcome is Outcome.CANCELLED or error == ERR_CANCELLED:
        return "cancelled"
    if error == ERR_SHUTDOWN:
        return "shutdown"
    if outcome is Outcome.ENDPOINT_FAILURE:
        return "crash"
    if error == ERR_TASK:
        return "exception"
    return {
        ERR_BAD_ARGS: "bad args",
        ERR_NOT_REGISTERED: "not registered",
        ERR_RESULT: "result",
    }.get(error, "failure")


def retry_cause(c: WorkerCompletion, config: CallConfig) -> str | None:
    """The cause of failed attempt ``c`` when ``config`` retries it, else None (attempts
    left are the caller's business)."""
    cause = failure_cause(c.outcome, c.error)
    if cause not in config.retry_on:
        return None
    if (
        cause == "exception"
        and config.retry_exceptions
        and not matches(c.message, config.retry_exceptions)
    ):
        return None
    return cause


def attempt_text(attempt: int, member: int | None, c: WorkerCompletion, where: str) -> str:
    """One line for a failed attempt: ``attempt 1: ENDPOINT_FAILURE (crash) on sub
    worker 0: <the first line of its error>``."""
    first = c.message.split("\n", 1)[0]
    if len(first) > MAX_CAUSE_CHARS:
        first = first[:MAX_CAUSE_CHARS] + "..."
    who = f" member {member}" if member is not None else ""
    return (
        f"attempt {attempt}{who}: {c.outcome.name} ({failure_cause(c.outcome, c.error)}) "
        f"on {where}: {first}"
    )
