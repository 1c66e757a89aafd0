"""The daemon's per-task metrics: tasks dispatched, tasks completed and their latency,
counted in plain integers on the event loop and turned into Prometheus families when
``/metrics`` is scraped.

These three move on every task (twice per task, at dispatch and at completion), so
they are not ``prometheus_client`` Counter and Histogram children: ``labels()`` and
``inc()``/``observe()`` took about 48 Python calls per task, which made a 20,000-task
run through a daemon with ``metrics.listen`` set about a third slower. A tally costs
one call per event, and renders the very series those objects rendered
(``<ns>_tasks_dispatched_total{kind}``, ``<ns>_tasks_completed_total{kind,outcome}``,
``<ns>_task_latency_seconds_{bucket,sum,count}{kind}`` with the same ``le`` bounds).

Everything here runs on the daemon's loop (the Scheduler's task events and the
scrapes both do), so no lock guards the counts.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["TaskTally"]


class TaskTally(Collector):
    """The counts of tasks dispatched and completed and their latency histogram, by
    kind (``sub``, ``chip``...) and outcome (``SUCCESS``...); a collector of the
    daemon's registry under ``namespace``. ``buckets``: the histogram's upper bounds
    in seconds, increasing (``+Inf`` is added)."""

    def __init__(self, namespace: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(
                f"cannot create the task tally: buckets {list(buckets)!r} are not increasing"
            )
        self._ns = namespace
        self._bounds = tuple(float(b) for b in buckets)
        # The bounds as prometheus_client writes them ("1e-05", "10.0").
        self._le = [floatToGoString(b) for b in self._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self.dispatched: dict[str, int] = {}
        self.completed: dict[tuple[str, str], int] = {}
        #: kind -> per-bucket counts (not cumulative; the last one past every bound).
        self._buckets: dict[str, list[int]] = {}
        #: kind -> the sum of the observed latencies (seconds).
        self._sums: dict[str, float] = {}

    def task_dispatched(self, kind: str) -> None:
        counts = self.dispatched
        counts[kind] = counts.get(kind, 0) + 1

    def task_completed(self, kind: str, outcome: str, latency: float | None = None) -> None:
        counts = self.completed
        key = (kind, outcome)
        counts[key] = counts.get(key, 0) + 1
        if latency is not None:
            self.observe(kind, latency)

    def observe(self, kind: str, seconds: float) -> None:
        """One dispatch-to-completion time of a ``kind`` task (``le`` is inclusive, as
        a Prometheus histogram's)."""
        per = self._buckets.get(kind)
        if per is None:
            per = self._buckets[kind] = [0] * len(self._le)
            self._sums[kind] = 0.0
        per[bisect_left(self._bounds, seconds)] += 1
        self._sums[kind] += seconds

    def collect(self) -> Iterator[Metric]:
        ns = self._ns
        dispatched = CounterMetricFamily(
            f"{ns}_tasks_dispatched", "Tasks published to a worker.", labels=["kind"]
        )
        for kind, n in self.dispatched.items():
            dispatched.add_metric([kind], float(n))
        yield dispatched
        completed = CounterMetricFamily(
            f"{ns}_tasks_completed",
            "Tasks that reached a terminal outcome.",
            labels=["kind", "outcome"],
        )
        for (kind, outcome), n in self.completed.items():
            completed.add_metric([kind, outcome], float(n))
        yield completed
        latency = HistogramMetricFamily(
            f"{ns}_task_latency_seconds",
            "Time from dispatch to completion of a task.",
            labels=["kind"],
        )
        for kind, per in self._buckets.items():
            cumulative: list[tuple[str, float]] = []
            total = 0
            for le, n in zip(self._le, per, strict=True):
                total += n
                cumulative.append((le, float(total)))
            latency.add_metric([kind], cumulative, self._sums[kind])
        yield latency

    def describe(self) -> Iterator[Metric]:
        """The families' names, for the registry's duplicate check (no samples)."""
        ns = self._ns
        yield CounterMetricFamily(f"{ns}_tasks_dispatched", "", labels=["kind"])
        yield CounterMetricFamily(f"{ns}_tasks_completed", "", labels=["kind", "outcome"])
        yield HistogramMetricFamily(f"{ns}_task_latency_seconds", "", labels=["kind"])
