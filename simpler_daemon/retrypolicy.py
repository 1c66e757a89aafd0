"""Automatic retries of a failed task: the policy a ``CallConfig`` carries and how a
failure is classified against it.

A retry is parent-side policy: the child's task frame is the same for every attempt
(``CallConfig.encoded`` does not carry it). The Scheduler (``scheduler/retries.py``) classifies
each failed attempt of a task whose config has ``max_retries``; a task is run again
while attempts remain and the failure's cause is in ``retry_on``::

    crash      the worker died under the task (ENDPOINT_FAILURE that is not a deadline)
    deadline   the task ran past ``deadline_ms`` (stopped by the child or the parent)
    exception  the callable raised (TASK_FAILURE); ``retry_exceptions`` narrows it to
               those classes and their subclasses (in-process) or qualified names

Bad args, an unregistered callable, a result that cannot be sent back and a cancel
are never retried: running again would fail the same way or undo a user's decision.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any, Final

__all__ = [
    "DEFAULT_RETRY_ON",
    "MAX_RETRIES",
    "RETRY_CAUSES",
    "check_retry_exceptions",
    "check_retry_on",
    "classes_line",
    "exception_classes",
    "exception_name",
    "is_qualified_name",
    "matches",
    "qualified_name",
]

#: The causes ``retry_on`` may name.
RETRY_CAUSES: Final = ("crash", "deadline", "exception")
#: What ``retry_on`` is when not given: every cause. Retrying is asked for with
#: ``max_retries``; ``retry_on`` and ``retry_exceptions`` narrow what is retried.
DEFAULT_RETRY_ON: Final = RETRY_CAUSES
#: The most retries one task may ask for (a crash loop must end).
MAX_RETRIES: Final = 100
#: A dotted Python name: ``ValueError``, ``json.JSONDecodeError``, ``pkg.mod.Cls.Inner``.
_QUALIFIED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
#: The exception's name in a task's error text: ``<prefix>: <name>: <message>``.
_FIRST_LINE = re.compile(r"^[^\n]*?: ((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::|$)", re.M)
#: ``classes_line``'s line, looked for in the text's first ``_SEARCH_CHARS`` characters.
_CLASSES = re.compile(r"^\[exception classes: ([\w.]+(?: < [\w.]+)*)\]$", re.M)
_SEARCH_CHARS: Final = 16384


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class; builtins' without their module (``ValueError``)."""
    module = cls.__module__
    if module in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def check_retry_on(value: object) -> tuple[str, ...]:
    """``retry_on`` as a tuple of causes; ``ValueError``/``TypeError`` naming the bad one."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(
            f"cannot build CallConfig: retry_on must be a tuple of {', '.join(RETRY_CAUSES)}, "
            f"got {type(value).__name__} {value!r}"
        )
    out: list[str] = []
    for item in value:
        if item not in RETRY_CAUSES:
            raise ValueError(
                f"cannot build CallConfig: retry_on has {item!r}, not one of "
                f"{', '.join(RETRY_CAUSES)}"
            )
        if item not in out:
            out.append(item)
    return tuple(out)


def check_retry_exceptions(value: object) -> tuple[type[BaseException] | str, ...]:
    """``retry_exceptions``: exception classes or their qualified names (``TypeError``
    naming the entry that is neither)."""
    if isinstance(value, (str, type)):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(
            "cannot build CallConfig: retry_exceptions must be a tuple of exception "
            f"classes, got {type(value).__name__} {value!r}"
        )
    out: list[type[BaseException] | str] = []
    for i, item in enumerate(value):
        if (isinstance(item, type) and issubclass(item, BaseException)) or (
            isinstance(item, str) and _QUALIFIED.fullmatch(item)
        ):
            out.append(item)
        else:
            what = (
                "a str that is not a qualified name"
                if isinstance(item, str)
                else type(item).__name__
            )
            raise TypeError(
                f"cannot build CallConfig: retry_exceptions[{i}] = {item!r} is not an "
                f"exception class or its qualified name ({what})"
            )
    return tuple(out)


def is_qualified_name(name: str) -> bool:
    """Whether ``name`` is a dotted Python name (``pkg.mod.Cls``)."""
    return _QUALIFIED.fullmatch(name) is not None


def classes_line(cls: type) -> str:
    """``[exception classes: pkg.MyError < ValueError < Exception < BaseException]``: the
    line a child's error text gives after its first (``children/sub.py``)."""
    return f"[exception classes: {' < '.join(qualified_name(k) for k in cls.__mro__[:-1])}]"


def exception_name(text: str) -> str | None:
    """The qualified name of the exception a failed task's error text starts with."""
    m = _FIRST_LINE.match(text)
    return m.group(1) if m else None


def exception_classes(text: str) -> list[str]:
    """The qualified names of the exception's class and its bases, from a failed task's
    error text (its ``classes_line``; else the class named by its first line alone)."""
    m = _CLASSES.search(text, 0, _SEARCH_CHARS)
    if m is not None:
        return m.group(1).split(" < ")
    name = exception_name(text)
    return [] if name is None else [name]


def matches(text: str, wanted: tuple[type[BaseException] | str, ...]) -> bool:
    """Whether the exception a failed task's error ``text`` names is one of ``wanted``
    or a subclass of one: by the names of its class and bases the child wrote, and by
    the class itself when this process has it loaded (in-process, the child's classes
    are the parent's)."""
    names = exception_classes(text)
    if not names:
        return False
    cls = _loaded_class(names[0])
    for w in wanted:
        if isinstance(w, str):
            if w in names:
                return True
        elif qualified_name(w) in names or (cls is not None and issubclass(cls, w)):
            return True
    return False


def _loaded_class(name: str) -> type | None:
    """The class ``name`` names in a module this process imported already (never imports)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        module = sys.modules.get(".".join(parts[:cut]) if cut else "builtins")
        if module is None:
            continue
        obj: Any = module
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, type):
            return obj
        return None
    return None
