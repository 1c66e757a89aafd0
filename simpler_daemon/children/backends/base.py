"""The chip backend interface a chip child drives.

Native lifecycle of one task, in the chip child::

    prepare(kernel, args, config, bank) -> token     may run while another token executes
    launch(token, on_launch)                          asynchronous; on_launch() fires at the
                                                      real launch boundary (sets the accepted word)
    poll(token) -> bool                               True once the device finished
    finalize(token)                                   exactly once per prepared token, launched or not

``pipeline_depth`` (1 or 2) is published to the parent before INIT_READY;
``supports_concurrent_prepare`` says whether ``prepare`` of a successor may
overlap a running token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class BackendError(Exception):
    """A backend phase failed; the task fails, the child keeps serving.

    ``token`` is set when the failed phase left a token that still needs its
    one ``finalize``.
    """

    def __init__(self, message: str, token: Any = None) -> None:
        super().__init__(message)
        self.token = token


class ChipToken(Protocol):
    bank: int
    dispatch_id: int


class ChipBackend(Protocol):
    pipeline_depth: int
    supports_concurrent_prepare: bool

    def prepare(
        self, kernel: Callable[..., Any], args: Any, config: Any, bank: int, dispatch_id: int
    ) -> ChipToken: ...

    def launch(self, token: ChipToken, on_launch: Callable[[], None]) -> None: ...

    def poll(self, token: ChipToken) -> bool: ...

    def finalize(self, token: ChipToken) -> None: ...

    def close(self) -> None: ...
