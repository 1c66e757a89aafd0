"""The reconnect schedule of a level-4 Worker, without sockets: ``ReconnectPolicy``
(capped exponential backoff, jitter that only shortens a step, its validation), the
words an ``Outage`` reports, and ``Worker(reconnect=...)``."""

from __future__ import annotations

from typing import Any

import pytest

from simpler_daemon.engine.remote_reconnect import Outage
from simpler_daemon.engine.worker import Worker
from simpler_daemon.remote.spec import ReconnectPolicy

pytestmark = pytest.mark.timeout(30)


# -- the schedule ------------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap_and_jitter_only_shortens() -> None:
    p = ReconnectPolicy(initial_s=0.5, max_s=8.0, multiplier=2.0, jitter=0.25)
    assert [p.delay(n, 0.0) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    for n in (1, 3, 5, 10_000):
        base = p.delay(n, 0.0)
        for rand in (0.0, 0.3, 0.999999):
            d = p.delay(n, rand)
            assert base * 0.75 <= d <= base <= p.max_s
    assert p.delay(2, 0.5) == pytest.approx(1.0 * (1 - 0.25 * 0.5))
    assert ReconnectPolicy(jitter=0.0).delay(1, 0.9) == 0.5
    assert ReconnectPolicy(multiplier=1.0, initial_s=2.0).delay(50, 0.0) == 2.0


def test_an_outage_describes_its_attempts_and_next_try() -> None:
    o = Outage("remote worker 1 (10.0.0.2:19073) failed: command connection closed", 100.0)
    o.attempts = 1
    assert o.describe(100.0).endswith("reconnecting; attempt 1 under way")
    o.last_error, o.next_at = "connection refused", 102.5
    assert o.backing_off and o.next_try_s(101.0) == 1.5
    assert o.describe(101.0) == (
        "remote worker 1 (10.0.0.2:19073) failed: command connection closed; reconnecting: "
        "attempt 1 failed (connection refused); next attempt in 1.5 s"
    )
    assert o.next_try_s(200.0) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_s": 0}, "0 < initial_s"),
        ({"initial_s": 5, "max_s": 1}, "<= max_s"),
        ({"max_elapsed_s": -1}, "max_elapsed_s=-1 must be >= 0"),
        ({"multiplier": 0.5}, "multiplier=0.5 must be >= 1"),
        ({"jitter": 1.0}, r"jitter=1.0 must be in \[0, 1\)"),
        ({"max_s": float("inf")}, "max_s=inf must be a number"),
        ({"initial_s": True}, "initial_s=True must be a number"),
    ],
)
def test_a_bad_policy_is_refused_naming_its_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReconnectPolicy(**kwargs)


def test_worker_reconnect_takes_a_policy_or_a_bool() -> None:
    with pytest.raises(TypeError, match="reconnect= must be a ReconnectPolicy"):
        Worker(level=4, reconnect="forever")  # type: ignore[arg-type]
    off = Worker(level=4, reconnect=False)
    slow = Worker(level=4, reconnect=ReconnectPolicy(max_s=60.0))
    default = Worker(level=4, restart_children=False)
    try:
        assert off._fleet.policy is None and default._fleet.policy is None
        assert slow._fleet.policy == ReconnectPolicy(max_s=60.0)
    finally:
        for w in (off, slow, default):
            w.close()
