"""Check a trace against the Chrome Trace Event format's rules (what Perfetto's and
chrome://tracing's JSON importers require of the events they load), offline.

The rules checked, from the format's specification ("Trace Event Format", the JSON
object form): the document is an object with a ``traceEvents`` list (``displayTimeUnit``
"ms" or "ns" and ``otherData`` an object when present); every event has a string
``name`` and ``ph``, integer ``pid`` and ``tid``; a complete event (``X``) has numeric
``ts`` and ``dur`` >= 0 (microseconds) and an object ``args``; a metadata event (``M``)
is ``process_name`` or ``thread_name`` with ``args.name`` a string. The document must
survive a JSON round trip unchanged (no NaN, no non-string keys).
"""

from __future__ import annotations

import json
import math
from typing import Any


def check_chrome_trace(doc: Any) -> list[dict[str, Any]]:
    """Assert ``doc`` is a well-formed Chrome trace; returns its complete (X) events."""
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text) == doc, "the trace does not survive a JSON round trip"
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list), doc
    if "displayTimeUnit" in doc:
        assert doc["displayTimeUnit"] in ("ms", "ns")
    if "otherData" in doc:
        assert isinstance(doc["otherData"], dict)
    complete: list[dict[str, Any]] = []
    named_threads: set[tuple[int, int]] = set()
    named_procs: set[int] = set()
    for ev in doc["traceEvents"]:
        assert isinstance(ev, dict), ev
        assert isinstance(ev.get("name"), str) and isinstance(ev.get("ph"), str), ev
        assert type(ev.get("pid")) is int and type(ev.get("tid")) is int, ev
        if ev["ph"] == "X":
            for key in ("ts", "dur"):
                v = ev.get(key)
                assert isinstance(v, (int, float)) and not isinstance(v, bool), ev
                assert math.isfinite(v), ev
            assert ev["dur"] >= 0 and ev["ts"] >= 0, ev
            assert isinstance(ev.get("args", {}), dict), ev
            complete.append(ev)
        elif ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name"), ev
            assert isinstance(ev.get("args", {}).get("name"), str), ev
            if ev["name"] == "process_name":
                named_procs.add(ev["pid"])
            else:
                named_threads.add((ev["pid"], ev["tid"]))
        else:
            raise AssertionError(f"unexpected phase {ev['ph']!r} in {ev}")
    for ev in complete:
        assert ev["pid"] in named_procs, f"no process_name for {ev}"
        assert (ev["pid"], ev["tid"]) in named_threads, f"no thread_name for {ev}"
    return complete


def task_events(doc: Any) -> list[dict[str, Any]]:
    """The task attempts of a checked trace, by (task, member, attempt)."""
    events = [ev for ev in check_chrome_trace(doc) if ev.get("cat") == "task"]
    return sorted(
        events,
        key=lambda ev: (ev["args"]["task"], ev["args"].get("member", 0), ev["args"]["attempt"]),
    )
