"""Chip kernels used by the chip tests: ``kernel(args, config)`` over heap views."""

from __future__ import annotations

import time
from typing import Any


def add_one(args: Any, config: Any) -> None:
    args.tensors[0][...] += 1


def write_scalar(args: Any, config: Any) -> None:
    args.tensors[0][args.scalars[0]] = args.scalars[1]


def sleep_ms(args: Any, config: Any) -> None:
    time.sleep(args.scalars[0] / 1000.0)


def boom(args: Any, config: Any) -> None:
    raise RuntimeError("kernel exploded")


def fail_prepare(args: Any, config: Any) -> None:
    pass


fail_prepare.sim_fail = "prepare"  # type: ignore[attr-defined]


def fail_launch(args: Any, config: Any) -> None:
    pass


fail_launch.sim_fail = "launch"  # type: ignore[attr-defined]


def slow_prepare(args: Any, config: Any) -> None:
    time.sleep(args.scalars[0] / 1000.0 if args.scalars else 0.0)


slow_prepare.sim_prepare_s = 0.005  # type: ignore[attr-defined]
