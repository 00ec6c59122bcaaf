import subprocess
import sys
from pathlib import Path

import pytest

import launch

ROOT = Path(__file__).resolve().parent.parent


def test_stamp_tracks_requirements_and_no_deps_packages(monkeypatch, tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("torch==2.13.0\n")
    monkeypatch.setattr(launch, "REQUIREMENTS", requirements)
    first = launch.wanted_stamp()
    requirements.write_text("torch==2.13.0\ngradio==6.31.0\n")
    assert launch.wanted_stamp() != first
    monkeypatch.setattr(launch, "NO_DEPS", ("other==1.0",))
    requirements.write_text("torch==2.13.0\n")
    assert launch.wanted_stamp() != first


def test_failure_is_one_cause_and_one_fix(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(SystemExit) as exit_info:
        launch.fail("the disk is full", "free some disk space")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Kestrel could not start: the disk is full" in err and "Fix: free some disk space" in err


def test_a_python_older_than_the_requirements_need_is_refused_by_name(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    launch.check_python((3, 11, 7))
    launch.check_python((3, 13, 0))
    with pytest.raises(SystemExit):
        launch.check_python((3, 10, 13))
    err = capsys.readouterr().err
    assert "Python 3.10 is too old" in err and "Python 3.11 or newer" in err


@pytest.mark.parametrize("command", [[], ["chat"], ["bench"], ["train-head"], ["ui"]])
def test_every_command_explains_its_options(command):
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *command, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: launch.py" in result.stdout and "--" in result.stdout


def test_bad_prompt_file_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "bench", "--prompts", str(tmp_path / "missing.jsonl")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'missing.jsonl'}: no such prompt file"
