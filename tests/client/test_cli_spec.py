"""Run specs of ``simplerctl submit``: typos and bad values are errors naming
the key, with "did you mean"; no daemon needed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from simpler_daemon.cli import simplerctl as cli
from simpler_daemon.cli.runspec import SPEC_FORMAT, SpecError, decode_spec, load_spec
from tests.support.daemon_harness import REPO

EXAMPLES = "simpler_daemon.examples.tasks"


def _spec(**task: object) -> dict[str, object]:
    return {"tasks": [{"callable": f"{EXAMPLES}:fill", "scalars": [1], **task}]}


def test_example_spec_decodes() -> None:
    spec = load_spec(str(REPO / "examples" / "run.toml"))
    assert [t.callable.rpartition(":")[2] for t in spec.tasks] == ["fill", "add", "scale"]
    assert spec.buffers["a"].shape == [8] and spec.label == "readme-demo"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # A misspelt key used to be dropped without a word.
        (
            _spec(tensor=[{"buffer": 1, "tag": "input"}]),
            "tasks[0].tensor: unknown key (did you mean 'tensors'?)",
        ),
        (
            {"buffers": {"x": {"shap": [4]}}, **_spec()},
            "buffers.x.shap: unknown key (did you mean 'shape'?)",
        ),
        # ... and ran as a 0-d buffer: shape is required.
        ({"buffers": {"x": {"dtype": "int8"}}, **_spec()}, "buffers.x.shape: required"),
        ({"label": "l", "task": []}, "task: unknown key (did you mean 'tasks'?)"),
        (
            _spec(members=[{"tensors": [{"buffer": 1, "tga": "input"}]}], scalars=None),
            "tasks[0].members[0].tensors[0].tga: unknown key (did you mean 'tag'?)",
        ),
        (_spec(config={"deadline": 5}), "tasks[0].config.deadline: unknown key (did you mean"),
        (_spec(zzz=1), "tasks[0].zzz: unknown key; known keys: callable, kind"),
        # A negative scalar was a traceback.
        (_spec(scalars=[-1]), "tasks[0].scalars[0]: Expected int >= 0 (scalars are unsigned"),
        (
            _spec(scalars=[1 << 64]),
            "tasks[0].scalars[0]: 18446744073709551616 is out of range (scalars are",
        ),
        # The run-spec loader applies TaskArgs.add_scalar's rule: nothing is converted.
        (_spec(scalars=[1.5]), "tasks[0].scalars[0]: Expected int, got float (scalars are"),
        (_spec(scalars=[True]), "tasks[0].scalars[0]: Expected int, got bool (scalars are"),
        (_spec(scalars=["7"]), "tasks[0].scalars[0]: Expected int, got str (scalars are"),
        (_spec(kind="group"), "tasks[0].kind: Invalid enum value 'group' (choose one of 'sub'"),
        (_spec(tensors=[{"buffer": 1}]), "tasks[0].tensors[0].tag: required"),
        ({"tasks": []}, "tasks: the run spec needs at least one task"),
        ({"label": "x"}, "tasks: required"),
        ({"buffers": {"x": {"shape": [-2]}}, **_spec()}, "buffers.x.shape[0]: Expected int >= 0"),
        ({"buffers": {"x": {"shape": [2], "dtype": "nope"}}, **_spec()}, "unknown dtype 'nope'"),
        (_spec(priority=2), "tasks[0].priority: unknown key"),
        ({"priority": 0, **_spec()}, "priority: Expected int >= 1"),
    ],
)
def test_bad_specs_name_the_key(data: dict[str, object], expected: str) -> None:
    with pytest.raises(SpecError) as info:
        decode_spec(data, "t.json")
    assert str(info.value).startswith("cannot load run spec t.json: ")
    assert expected in str(info.value)


def test_cli_reports_a_typo_without_a_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "typo.toml"
    spec.write_text('[buffers.x]\nshap = [4]\n[[tasks]]\ncallable = "m:f"\n')
    # The spec is checked before the daemon is contacted: no socket needed.
    code = cli.main(["--socket", str(tmp_path / "none.sock"), "submit", str(spec)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert "buffers.x.shap: unknown key (did you mean 'shape'?)" in err
    assert "Traceback" not in err


def test_spec_format_in_submit_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "simpler_daemon.cli", "submit", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0
    assert "[buffers.a]" in proc.stdout and "Unknown keys are errors" in proc.stdout
    assert SPEC_FORMAT.splitlines()[0] in proc.stdout


def test_readme_documents_the_spec_format() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Run specs") :]
    start = section.index("```toml\n") + len("```toml\n")
    block = section[start : section.index("```", start)]
    spec = decode_spec(tomllib.loads(block), "README.md")  # the documented example is valid
    assert [t.kind for t in spec.tasks] == ["sub", "sub_group"] and spec.buffers["out"].shape
    for key in ("[buffers.", "[[tasks]]", "[[tasks.members]]", "idempotency_key", "did you mean"):
        assert key in section, key


def test_json_spec_from_stdin_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(_spec(kind="sub"))))
    assert load_spec("-").tasks[0].kind == "sub"


@pytest.mark.parametrize(
    ("buffer", "expected"),
    [
        # 1e400 used to parse as inf and be stored silently.
        ("fill = 1e400", "buffers.b.fill: 1e400 is out of range of a 64-bit float"),
        ("data = [1.0, -1e999]", "buffers.b.data[1]: -1e999 is out of range of a 64-bit float"),
    ],
)
def test_float_literal_overflow_names_the_key(tmp_path: Path, buffer: str, expected: str) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(
        f'[buffers.b]\nshape = [2]\n{buffer}\n[[tasks]]\ncallable = "{EXAMPLES}:fill"\n'
    )
    with pytest.raises(SpecError, match=re.escape(expected)):
        load_spec(str(spec))
    spec.write_text(
        f'[buffers.b]\nshape = [2]\nfill = -inf\n[[tasks]]\ncallable = "{EXAMPLES}:fill"\n'
    )
    assert load_spec(str(spec)).buffers["b"].fill == float("-inf")  # written explicitly
    js = tmp_path / "s.json"
    js.write_text('{"buffers": {"b": {"shape": [2], "fill": 1e400}}, "tasks": []}')
    with pytest.raises(SpecError, match=re.escape("buffers.b.fill: 1e400 is out of range")):
        load_spec(str(js))
