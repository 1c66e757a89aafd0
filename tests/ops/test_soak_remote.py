"""How the remote phase of the soak (``benchmarks/soak_remote.py``) judges what it saw:
a run is fine only when it completed, or failed by its own remote worker during a blip
of that worker's host; a wrong value, a stuck run or a failure with no blip to explain
it is a problem. The phase itself runs in ``test_soak_smoke.py``."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.soak_remote import SHORT_S, Outcome, RemoteReport, _scaled, classify
from benchmarks.soak_remote_jobs import WRONG, check

WINDOWS = {0: [(10.0, 20.0)], 1: []}
CAUSE = "remote worker 0 (10.77.0.2:19073) failed: health lane silent for 3.0 s"


def judged(*outcomes: Outcome) -> RemoteReport:
    report = RemoteReport("remote")
    classify(report, list(outcomes), WINDOWS)
    return report


def test_a_completed_run_and_a_failure_during_a_blip_of_its_host_are_fine() -> None:
    report = judged(
        Outcome(1, 0, 1.0, 2.0, "COMPLETED"),
        Outcome(2, 0, 9.0, 11.0, "FAILED", "ENDPOINT_FAILURE", CAUSE),
        Outcome(3, 0, 21.0, 21.5, "FAILED", "ENDPOINT_FAILURE", CAUSE),  # within the slack
    )
    assert (report.completed, report.failed_with_cause, report.problems) == (1, 2, [])


@pytest.mark.parametrize(
    ("outcome", "problem"),
    [
        (Outcome(4, 0, 30.0, 31.0, "FAILED", "ENDPOINT_FAILURE", CAUSE), "with no blip"),
        (Outcome(5, 1, 12.0, 13.0, "FAILED", "ENDPOINT_FAILURE", CAUSE), "with no blip"),
        (Outcome(6, 0, 12.0, 13.0, "FAILED", "TASK_FAILURE", "ValueError: x"), "during a blip"),
        (Outcome(7, 0, 12.0, 13.0, "FAILED", "TASK_FAILURE", f"{WRONG}: 1 of 8"), "WRONG RESULT"),
        (Outcome(8, 0, 12.0, 13.0, "RUNNING"), "still RUNNING"),
    ],
)
def test_anything_else_is_a_problem(outcome: Outcome, problem: str) -> None:
    report = judged(outcome)
    assert report.completed == report.failed_with_cause == 0
    assert len(report.problems) == 1 and problem in report.problems[0], report.problems
    assert f"run {outcome.run_id} on remote worker {outcome.worker}" in report.problems[0]


def test_the_remote_check_refuses_a_wrong_value() -> None:
    class Args:
        tensors = [np.array([5.0, 5.0, -1.0])]
        scalars = [5]

    with pytest.raises(ValueError, match=f"{WRONG}: 1 of 3 elements differ"):
        check(Args())
    Args.tensors = [np.full(3, 5.0)]
    check(Args())


def test_short_phases_draw_short_blips_that_can_still_outlast_the_session_timeout() -> None:
    assert _scaled((1.0, 15.0), 1.0) == (1.0, 15.0)
    assert _scaled((1.0, 15.0), 0.1) == (1.0, 1.0 + SHORT_S)
    assert _scaled((2.0, 6.0), 0.1) == (2.0, 6.0)
    assert 1.0 + SHORT_S > 3.0  # the session timeout of the phase
