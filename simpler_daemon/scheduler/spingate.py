"""Whether the Scheduler spins before it parks: the spin gate.

While a task is in flight the parent either spins (watching the doorbell word,
yielding the core between looks) or parks on the doorbell eventfd (no CPU, but
a wake-up on the completion path). Spinning pays while tasks finish within the
spin budget; for long tasks (500 µs of CPU each, say) it would only take CPU from
the children. The
gate keeps a smoothed *hit rate*: the share of completions that arrived within
``spin_s`` of their dispatch, which is exactly what a spin can observe::

    hit rate >= 1/2                spin up to spin_s, then park
    hit rate <  1/2 (park mode)    park at once; every probe gap, one probe: spin
                                   as in spin mode until a completion or a park

A rate, not a mean latency: a loaded machine's rare multi-millisecond
completions would pull a mean over the budget while most tasks still arrive
within it (a fresh Worker then parked on nearly every run, at twice the
latency). Three rules keep park mode from locking itself in (without them, after
a slow warm-up the Scheduler parked on 1,592 of 2,000 one-task runs, because
every parked observation includes the wake-up and so looked slow):

* A task that was in flight across a park that began before its spin budget
  ran out is *censored*: whether a spin would have caught it is unknown (its
  observed time includes the wake-up), so it is not counted. A task still
  running after a whole spin is a miss for sure.
* A probe measures what parking hides: a completion it catches is a hit, and
  probing goes on while it hits, until spin mode is back.
* A probe that runs out (a park with a task in flight, or a miss) doubles the
  gap to the next probe, from ``PROBE_MIN_S`` up to ``PROBE_MAX_S``: long tasks
  lose at most about one spin per ``PROBE_MAX_S`` of parent CPU to probes.
"""

from __future__ import annotations

from typing import Final

#: The smoothing of the hit rate (one completion moves it by 1/8 of the way).
RATE_ALPHA: Final = 0.125
#: Spin while at least this share of completions arrives within the spin.
MIN_HIT_RATE: Final = 0.5
#: The first gap between two probes in park mode, and the cap it doubles up to.
PROBE_MIN_S: Final = 0.001
PROBE_MAX_S: Final = 0.1


class SpinGate:
    """The spin-or-park decision of one Scheduler (see the module docstring)."""

    __slots__ = (
        "_probe_at",
        "_probe_gap",
        "_probing",
        "hit_rate",
        "parked_at",
        "probes",
        "spin_s",
    )

    def __init__(self, spin_s: float) -> None:
        if spin_s < 0:
            raise ValueError(f"cannot create the spin gate: spin_s {spin_s} is negative")
        self.spin_s = spin_s
        #: Smoothed share of counted completions that arrived within ``spin_s``.
        self.hit_rate = 1.0
        #: ``time.monotonic()`` when the latest park began (0: never parked).
        self.parked_at = 0.0
        #: Probes granted in park mode (a statistic).
        self.probes = 0
        self._probing = False
        self._probe_at = 0.0
        self._probe_gap = PROBE_MIN_S

    @property
    def parking_mode(self) -> bool:
        """True while most tasks outlast the spin budget (the Scheduler parks at once)."""
        return self.hit_rate < MIN_HIT_RATE

    def budget(self, now: float) -> float:
        """How long to spin before parking from ``now`` (``time.monotonic()``)."""
        if self.hit_rate >= MIN_HIT_RATE or self._probing:
            return self.spin_s
        if now >= self._probe_at:
            self._probing = True
            self.probes += 1
            return self.spin_s
        return 0.0

    def parked(self, now: float, busy: bool) -> None:
        """The Scheduler parks at ``now``; ``busy``: a task is in flight."""
        self.parked_at = now
        if self._probing and busy:
            self._probe_failed(now)

    def observe(self, issued_at: float, now: float) -> None:
        """A completion observed at ``now`` of a task dispatched at ``issued_at``."""
        spin = self.spin_s
        parked_at = self.parked_at
        if parked_at > issued_at and parked_at - issued_at < spin:
            return  # censored: a spin might have caught it; the wake-up hides whether
        if now - issued_at < spin:
            self.hit_rate += RATE_ALPHA * (1.0 - self.hit_rate)
            self._probe_gap = PROBE_MIN_S
            if self.hit_rate >= MIN_HIT_RATE:
                self._probing = False  # spin mode is back
        else:
            self.hit_rate -= RATE_ALPHA * self.hit_rate
            if self._probing:
                self._probe_failed(now)

    def observe_caught(self, k: int, now: float) -> None:
        """``k`` completions observed at ``now`` of tasks dispatched at ``now``: what
        ``observe(now, now)`` k times does, in one call (the SUB pump's bulk, W2)."""
        if self.spin_s <= 0:  # no latency is below a zero spin: each is a miss
            for _ in range(k):
                self.observe(now, now)
            return
        if k > 0:
            self.hit_rate = 1.0 - (1.0 - self.hit_rate) * (1.0 - RATE_ALPHA) ** k
            self._probe_gap = PROBE_MIN_S
            if self.hit_rate >= MIN_HIT_RATE:
                self._probing = False  # spin mode is back

    def _probe_failed(self, now: float) -> None:
        self._probing = False
        self._probe_at = now + self._probe_gap
        self._probe_gap = min(self._probe_gap * 2, PROBE_MAX_S)
