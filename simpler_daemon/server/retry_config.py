"""The daemon's side of automatic retries: a CallConfig message's retry fields checked
field by field (``tasks[2].config.retry_on[1]``), and the in-place writes a retried
task may not do without ``idempotent`` refused at submit with the field.

The policy itself (what is retried, how exceptions match) is the engine's
(``simpler_daemon/retrypolicy.py``, ``scheduler/retries.py``); through the daemon
``retry_exceptions`` are qualified class names, matched against the class the child
raised and its bases.
"""

from __future__ import annotations

from typing import Any

from simpler_daemon.args import CallConfig, Tag, TaskArgs
from simpler_daemon.errors import InvalidField
from simpler_daemon.retrypolicy import MAX_RETRIES, RETRY_CAUSES, is_qualified_name

__all__ = ["check_retry_safe", "retry_fields"]


def retry_fields(msg: Any, field: str) -> dict[str, Any]:
    """The retry settings of a CallConfig message as ``CallConfig`` keywords, each entry
    checked with the field it came from (``tasks[2].config.retry_on[1]``)."""
    if not (msg.max_retries or msg.retry_on or msg.retry_exceptions or msg.idempotent):
        return {}
    if msg.max_retries > MAX_RETRIES:
        raise InvalidField(f"{field}.max_retries", f"{msg.max_retries} is more than {MAX_RETRIES}")
    for i, cause in enumerate(msg.retry_on):
        if cause not in RETRY_CAUSES:
            raise InvalidField(
                f"{field}.retry_on[{i}]", f"{cause!r} is not one of {', '.join(RETRY_CAUSES)}"
            )
    for i, name in enumerate(msg.retry_exceptions):
        if not is_qualified_name(name):
            raise InvalidField(
                f"{field}.retry_exceptions[{i}]",
                f"{name!r} is not a qualified exception class name (e.g. ValueError, "
                "json.JSONDecodeError)",
            )
    out: dict[str, Any] = {
        "max_retries": msg.max_retries,
        "retry_exceptions": tuple(msg.retry_exceptions),
        "idempotent": msg.idempotent,
    }
    if msg.retry_on:
        out["retry_on"] = tuple(msg.retry_on)
    return out


def check_retry_safe(args_list: list[TaskArgs], config: CallConfig, where: str) -> None:
    """What the engine refuses at submit, refused here with the field: a retried task
    that writes a tensor in place without ``idempotent``."""
    for m, a in enumerate(args_list):
        for k, tag in enumerate(a.tags):
            if tag in (Tag.INOUT, Tag.OUTPUT_EXISTING):
                raise InvalidField(
                    f"{where}.config.idempotent",
                    f"the task has max_retries={config.max_retries} and writes members[{m}]."
                    f"tensors[{k}] in place ({tag.name}): a failed attempt's partial write "
                    "would be read by the next attempt; set idempotent if running it again "
                    "is safe",
                )
