"""``simplerctl`` run in this process against a daemon (``Ctl``): exit code, stdout and
stderr of one command line, for the simplerctl and CLI tests."""

from __future__ import annotations

import json
from typing import Any

import pytest

from simpler_daemon.cli import simplerctl as cli


class Ctl:
    def __init__(self, socket: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.socket = socket
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = cli.main(["--socket", self.socket, *argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str) -> Any:
        code, out, err = self("--json", *argv)
        assert code == 0, err
        return json.loads(out)
