import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
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


def test_an_incomplete_venv_is_made_again(monkeypatch, tmp_path, capsys):
    """A .venv without pip (a first run cut short) or whose Python is gone is
    found and made again; a working one is kept."""
    venv = tmp_path / ".venv"
    monkeypatch.setattr(launch, "VENV", venv)
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "in_venv", lambda: False)
    python = venv / ("Scripts/python.exe" if launch.os.name == "nt" else "bin/python")
    assert launch.venv_problem() == "missing"
    python.parent.mkdir(parents=True)
    python.symlink_to(tmp_path / "removed-python")
    assert launch.venv_problem() == "its Python is gone"
    python.unlink()
    python.symlink_to(Path(sys.executable).resolve())
    (venv / "pyvenv.cfg").touch()  # venv writes one: without it .venv's Python runs outside .venv
    assert launch.venv_problem() is None  # this Python has pip
    python.unlink()
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    assert launch.venv_problem() == "it has no working pip"
    python.write_text('#!/bin/sh\necho "3 10"\n')  # a Python too old for the pinned packages, pip or not
    assert launch.venv_problem() == "it was made with Python 3.10; the pinned packages need 3.11 to 3.14"
    python.write_text("#!/bin/sh\nexit 1\n")

    installed, real_run = [], subprocess.run

    def fake_venv(command, **kwargs):  # `python -m venv DIR`: a working one, linked to this Python
        if command[1:3] != ["-m", "venv"]:
            return real_run(command, **kwargs)
        python.parent.mkdir(parents=True)
        python.symlink_to(Path(sys.executable).resolve())
        (venv / "pyvenv.cfg").touch()

    monkeypatch.setattr(launch.subprocess, "run", fake_venv)
    monkeypatch.setattr(launch, "run_pip", lambda args, step: installed.append(step))
    launch.bootstrap()
    out = capsys.readouterr().out
    assert "cannot be used (it has no working pip): making it again" in out and "(first run: a few minutes)" in out
    assert launch.venv_problem() is None and len(installed) == 2
    assert launch.STAMP.read_text() == launch.wanted_stamp()
    launch.bootstrap()  # up to date: nothing is done
    assert len(installed) == 2
    launch.STAMP.write_text("an older requirements.txt")
    launch.bootstrap()  # the same .venv, its packages installed again
    assert "[2/2] Installing packages (requirements.txt changed)" in capsys.readouterr().out and len(installed) == 4
    launch.STAMP.unlink()  # an install cut short (Ctrl+C, offline): finished, not called a change of requirements.txt
    launch.bootstrap()
    assert "[2/2] Installing packages (finishing an install that was cut short)" in capsys.readouterr().out and len(installed) == 6

    def failing(args, step):
        launch.fail(f"{step} failed: ERROR: No matching distribution found for torch", "fix the cause")

    launch.STAMP.unlink()
    monkeypatch.setattr(launch, "run_pip", failing)
    with pytest.raises(SystemExit):
        launch.bootstrap()
    capsys.readouterr()
    monkeypatch.setattr(launch, "run_pip", lambda args, step: installed.append(step))
    launch.bootstrap()  # a failed install is not said to have been cut short
    assert "[2/2] Installing packages (trying again the install that failed at the last start)" in capsys.readouterr().out
    assert launch.STAMP.exists() and not (venv / "kestrel-install-failed").exists()
    launch.STAMP.unlink()
    launch.bootstrap()
    assert "cut short" in capsys.readouterr().out
    launch.STAMP.unlink()
    monkeypatch.setattr(launch, "run_pip", failing)
    with pytest.raises(SystemExit):
        launch.bootstrap()

    def stopped(args, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_pip", stopped)  # the retry stopped with Ctrl+C: cut short, not failed
    with pytest.raises(KeyboardInterrupt):
        launch.bootstrap()
    monkeypatch.setattr(launch, "run_pip", lambda args, step: installed.append(step))
    launch.bootstrap()
    assert "finishing an install that was cut short" in capsys.readouterr().out


def test_pip_s_downloads_are_shown_with_their_size():
    """pip draws no progress bar into a pipe: torch's download (minutes on a slow
    line) showed nothing between "Collecting torch" and "Installing"."""
    url = "Downloading https://files.pythonhosted.org/packages/ab/cd/" + "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (180.2 MB)"
    assert launch.pip_progress(f"  {url}\n") == "Downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (180.2 MB)"
    assert launch.pip_progress("  Downloading numpy-2.1.0.tar.gz (18.9 MB)\n") == "Downloading numpy-2.1.0.tar.gz (18.9 MB)"
    assert launch.pip_progress("Collecting torch==2.13.0 (from -r requirements.txt (line 1))\n").startswith("Collecting torch")
    assert launch.pip_progress("  Using cached x.whl\n") is None and launch.pip_progress("     ━━━━━━ 1.2/180.2 MB\n") is None


def test_a_venv_that_cannot_be_made_gets_the_fix_for_its_cause():
    assert "cannot be written: copy Kestrel into a folder you own" in launch.venv_fix("Error: [Errno 13] Permission denied: '/x/.venv'")
    assert "free some disk space" in launch.venv_fix("OSError: [Errno 28] No space left on device")
    assert "apt install python3-venv" in launch.venv_fix("Error: Command '[...ensurepip...]' returned non-zero exit status 1.")


def test_a_python_older_than_the_requirements_need_is_refused_by_name(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    launch.check_python((3, 11, 7))
    launch.check_python((3, 13, 0))
    with pytest.raises(SystemExit):
        launch.check_python((3, 10, 13))
    err = capsys.readouterr().err
    assert "Python 3.10 is too old" in err and "Python 3.11 or newer" in err
    launch.check_python((3, 14, 1))
    with pytest.raises(SystemExit):
        launch.check_python((3, 15, 0))
    assert "Python 3.15 is newer than the pinned PyTorch 2.13 supports (3.11 to 3.14)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("system", "machine", "release", "bits", "problem"),
    [
        ("linux", "x86_64", "", 64, None),
        ("linux", "aarch64", "", 64, None),
        ("win32", "AMD64", "", 64, None),
        ("darwin", "arm64", "14.5", 64, None),
        ("darwin", "arm64", "15.0", 64, None),
        ("darwin", "x86_64", "14.5", 64, "no build for macOS on x86-64"),
        ("darwin", "arm64", "13.6.1", 64, "needs macOS 14 or newer (this Python reports macOS 13.6.1)"),
        ("win32", "ARM64", "", 64, "no build for Windows on arm64"),
        ("linux", "ppc64le", "", 64, "no build for Linux on ppc64le"),
        ("win32", "AMD64", "", 32, "32-bit build"),
    ],
)
def test_platforms_without_a_pytorch_build_are_named_before_installing(system, machine, release, bits, problem):
    found = launch.platform_problem(system, machine, release, bits)
    assert found is None if problem is None else problem in found


def test_windows_console_run_passes_utf8_and_the_exit_code(monkeypatch, tmp_path):
    """The Windows path (Popen and wait, not execv): the child's output is
    UTF-8 and its exit code comes back; without a console nothing waits."""
    monkeypatch.setattr(sys, "stdin", None)
    out = tmp_path / "out.txt"
    script = f"import os, sys; open({str(out)!r}, 'w').write(os.environ.get('PYTHONUTF8', '')); sys.exit(3)"
    assert launch.run_in_console([sys.executable, "-c", script]) == 3
    assert out.read_text() == "1"


def test_an_error_waits_for_enter_only_where_the_window_closes_when_kestrel_ends(monkeypatch):
    """A terminal the user opened stays (a script over ssh must not wait);
    a Linux shortcut's and a Windows console close, so there it waits."""
    asked = []
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt))
    monkeypatch.setattr(launch.os, "name", "posix")
    monkeypatch.delenv(launch.SHORTCUT, raising=False)
    launch.hold_window("Press Enter to close.")
    assert asked == [] and not launch.window_closes()
    monkeypatch.setenv(launch.SHORTCUT, "1")
    launch.hold_window("Press Enter to close.")
    assert asked == ["Press Enter to close."] and launch.window_closes()
    monkeypatch.delenv(launch.SHORTCUT)
    monkeypatch.setattr(launch.os, "name", "nt")
    assert launch.window_closes()


@pytest.mark.parametrize("command", [[], ["chat"], ["bench"], ["train-head"], ["ui"]])
def test_every_command_explains_its_options(command):
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *command, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: launch.py" in result.stdout and "--" in result.stdout


def test_the_test_command_runs_the_files_it_is_given_from_any_folder(tmp_path):
    """`launch.py test tests/test_tree.py` runs that file, not the whole suite
    (which it did with the file as well), and finds it from another folder too."""
    from app.cli import pytest_arguments

    tests = str(ROOT / "tests")
    assert pytest_arguments([], ROOT) == [tests]
    assert pytest_arguments(["-q", "-k", "tests"], tmp_path) == [tests, "-q", "-k", "tests"]  # -k's value is no path
    assert pytest_arguments(["-xk", "tests"], tmp_path) == [tests, "-xk", "tests"]  # nor with -x written beside it
    tree_file = str(ROOT / "tests" / "test_tree.py")
    assert pytest_arguments(["-kmock", "tests/test_tree.py"], tmp_path) == ["-kmock", tree_file]  # an attached value
    tree = str(ROOT / "tests" / "test_tree.py")
    assert pytest_arguments(["-q", "tests/test_tree.py"], ROOT) == ["-q", tree]
    assert pytest_arguments(["tests/test_tree.py::test_x", "-x"], tmp_path) == [f"{tree}::test_x", "-x"]
    assert pytest_arguments(["--ignore", "tests/test_tree.py"], tmp_path) == [tests, "--ignore", tree]  # still the whole suite, less one file
    (tmp_path / "report.xml").write_text("")
    assert pytest_arguments(["--junit-xml", "report.xml"], tmp_path) == [tests, "--junit-xml", "report.xml"]
    (tmp_path / "tests").mkdir()
    assert pytest_arguments(["tests"], tmp_path) == [str(tmp_path / "tests")]  # the current folder's first
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "test", "--collect-only", "-q", "tests/test_tree.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path.parent,
    )  # fmt: skip
    assert result.returncode == 0 and "tests/test_tree.py::" in result.stdout and "test_api.py" not in result.stdout


def test_bad_prompt_file_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "bench", "--prompts", str(tmp_path / "missing.jsonl")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'missing.jsonl'}: no such prompt file"


def test_bad_options_are_refused_by_name_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Each bad invocation ends with exit code 2 and one line naming the option
    or file; none loads a model (load_base would fail the test)."""
    from app import cli

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("app.session.load_pair", no_model)
    monkeypatch.setattr("models.base.load_base", no_model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w1 w2"]}\n')
    (tmp_path / "string-turns.jsonl").write_text('{"turns": "w1 w2"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "blank-prompt.jsonl").write_text('{"turns": ["w1"]}\n{"turns": ["  "]}\n')
    (tmp_path / "same-ids.jsonl").write_text('{"id": "a", "turns": ["w1"]}\n{"id": "a", "turns": ["w2"]}\n')
    (tmp_path / "features" / "train").mkdir(parents=True)
    (tmp_path / "features" / "train" / "shard-00000.safetensors").write_bytes(b"")
    (tmp_path / "out" / "work" / "features").mkdir(parents=True)  # train-head's --out, given for its features
    (tmp_path / "turn-ids.jsonl").write_text('{"id": "a", "turns": ["w1", "w2"]}\n{"id": "a#2", "turns": ["w3"]}\n')
    bundled_head = ROOT / "assets" / "heads" / "SmolLM2-135M-Instruct"
    (tmp_path / "cut").mkdir()  # a head whose weights file was cut short (a download stopped): its header names more than it has
    (tmp_path / "cut" / "config.json").write_bytes((bundled_head / "config.json").read_bytes())
    (tmp_path / "cut" / "model.safetensors").write_bytes((bundled_head / "model.safetensors").read_bytes()[:100_000])
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(bundled_head / "model.safetensors"))
    (tmp_path / "cut-bin").mkdir()  # the same, saved by PyTorch (pytorch_model.bin), cut short
    (tmp_path / "cut-bin" / "config.json").write_bytes((bundled_head / "config.json").read_bytes())
    torch.save(weights, tmp_path / "whole.bin")
    (tmp_path / "cut-bin" / "pytorch_model.bin").write_bytes((tmp_path / "whole.bin").read_bytes()[:-5_000])
    (tmp_path / "empty-bin").mkdir()  # a download that wrote nothing
    (tmp_path / "empty-bin" / "config.json").write_bytes((bundled_head / "config.json").read_bytes())
    (tmp_path / "empty-bin" / "pytorch_model.bin").write_bytes(b"")
    (tmp_path / "shards").mkdir()  # sharded, one shard missing (a download stopped between files)
    (tmp_path / "shards" / "config.json").write_bytes((bundled_head / "config.json").read_bytes())
    names = sorted(weights)
    (tmp_path / "shards" / "model-00001-of-00002.safetensors").write_bytes((bundled_head / "model.safetensors").read_bytes())
    index = {"weight_map": {name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(names)}}
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(json.dumps(index))
    from core.training.features import is_held_out

    held = [f"q{i}" for i in range(400) if is_held_out(f"q{i}", 0.05)][:2]  # train-head holds these out
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"id": pid, "turns": ["w1 w2"]}) + "\n" for pid in held))
    (tmp_path / "mixed.jsonl").write_text('{"id": "self-0-0", "turns": ["w1 w2 w3"]}\n')  # an earlier --keep-prompts output
    own = ["self-prompts", "--prompts", str(prompts), "--out", str(tmp_path / "self.jsonl"), "--work", str(tmp_path / "sw")]
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    (tmp_path / "surrogate.jsonl").write_text('{"turns": ["w1 \\ud800 w2"]}\n')  # valid JSON, no UTF-8 text
    (tmp_path / "long-number.jsonl").write_text('{"turns": ["w1"], "id": 1' + "0" * 5000 + "}\n")
    cases = [
        (["chat", "  "], "the prompt is empty"),
        (["chat", "w1 \udcff w2"], "the prompt is not UTF-8 text (byte 0xff at character 3)"),  # as Python reads a Latin-1 byte
        (["chat", "w1", "--system", "s\udce9"], "--system is not UTF-8 text (byte 0xe9 at character 1)"),
        (["bench", "--prompts", str(tmp_path / "deep.jsonl")], "deep.jsonl:1: not valid JSON (nested too deeply)"),
        (["bench", "--prompts", str(tmp_path / "long-number.jsonl")], "long-number.jsonl:1: not valid JSON (a number of too many digits)"),
        (["bench", "--prompts", str(tmp_path / "same-ids.jsonl")], "same-ids.jsonl:2: id 'a' is already the id of line 1"),
        (["eval-heads", "--features", str(tmp_path / "features"), "--head", str(tmp_path)], "no feature shards; it has train shards (--split train)"),
        (["eval-heads", "--features", str(tmp_path / "nowhere"), "--head", str(tmp_path)], "nowhere: no such folder; give the features folder"),
        (["eval-heads", "--features", str(prompts), "--head", str(tmp_path)], "prompts.jsonl: is a file; give the features folder"),
        (["eval-heads", "--features", str(tmp_path / "out"), "--head", str(tmp_path)],
         f"it is a train-head --out folder: give --features {tmp_path / 'out' / 'work' / 'features'}"),
        ([*own[:2], str(tmp_path / "held.jsonl"), *own[3:]], "held.jsonl: every prompt is in train-head's held-out split"),
        ([*own[:4], str(prompts), *own[5:]], "is the --prompts file; write the requests to another file"),
        ([*own[:4], str(tmp_path / "sw" / "requests.jsonl"), *own[5:]], "is where --work keeps the cached requests"),
        ([*own[:2], str(tmp_path / "mixed.jsonl"), *own[3:], "--keep-prompts"], "holds self-0-0, an id the requests of --seed 0 take"),
        (["chta", "hi"], "unknown command 'chta'"),
        (["ui", "--port", "70000"], "--port: must be from 1 to 65535"),
        (["ui", "--max-queue", "0"], "--max-queue: must be at least 1"),
        (["chat", "hi", "--tree-top-k", "0"], "--tree-top-k: must be from 1 to 32, got 0"),
        (["chat", "hi", "--top-k", "1000001"], "--top-k: must be from -1 to 1000000, got 1000001"),  # the API's range (-1: off)
        (["chat", "hi", "--top-k", "-2"], "--top-k: must be from -1 to 1000000, got -2"),
        (["chat", "hi", "--total-tokens", "300"], "--total-tokens: must be from 0 to 256, got 300"),  # the API's range
        (["bench", "--prompts", str(prompts), "--modes", "eagle2:300/4/2"], "its total_tokens must be from 0 to 256, got 300"),
        (["chat", "hi", "--total-tokens", "1"], "--total-tokens: must be 0 (sized by the planner) or from 2 to 256, got 1"),
        (["bench", "--prompts", str(prompts), "--modes", "vanilla,eagle2:1/8/6"], "bad mode 'eagle2:1/8/6': total_tokens must be 0"),
        (["bench", "--prompts", str(prompts), "--modes", "vanilla,llama.cpp", "--llama-python", sys.executable, "--temperature", "0.5"],
         "mode llama.cpp is measured greedy only"),
        (["eval-heads", "--features", str(tmp_path / "features"), "--compile", "on"], "unrecognized arguments: --compile"),  # nothing compiles there
        (["chat", "hi", "--temperature", "nan"], "--temperature: must be a number"),
        (["bench", "--prompts", str(prompts), "--seed", str(2**63)], f"--seed: must be from {-(2**63)} to {2**63 - 1}"),  # as the API takes
        (["train-head", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--seed", "-1"], "--seed: must be from 0 to"),
        (["chat", "hi", "--temperature", "5"], "--temperature: must be a number at least 0 and at most 2, got 5"),
        (["bench", "--prompts", str(tmp_path / "turn-ids.jsonl"), "--turns", "2"], "prompt a#2: the rows of prompt a's turn 2 are named so"),
        (["chat", "hi", "--model", str(tmp_path), "--mode", "eagle2"], "--mode eagle2 needs a draft head: give --head HEAD"),
        (["chat", "hi", "--model", str(tmp_path / "mistyped"), "--mode", "eagle2"], "mistyped: no such file or folder, and not a Hugging Face repo id"),
        (["bench", "--prompts", str(prompts), "--other-head", f"x={tmp_path / 'cut'}", "--modes", "vanilla,eagle2@x"],
         "cut/model.safetensors: cannot read the weights"),
        (["bench", "--prompts", str(prompts), "--other-head", f"x={tmp_path / 'cut-bin'}", "--modes", "vanilla,eagle2@x"],
         "cut-bin/pytorch_model.bin: not a readable PyTorch checkpoint (damaged, cut short"),
        (["bench", "--prompts", str(prompts), "--other-head", f"x={tmp_path / 'shards'}", "--modes", "vanilla,eagle2@x"],
         "names the shard model-00002-of-00002.safetensors, which is not in"),
        (["bench", "--prompts", str(prompts), "--other-head", f"x={tmp_path / 'empty-bin'}", "--modes", "vanilla,eagle2@x"],
         "empty-bin/pytorch_model.bin: not a readable PyTorch checkpoint"),
        (["chat", "hi", "--threads", "10000"], f"--threads: this computer has {os.cpu_count()} logical CPU"),  # more only wait on each other
        (["bench", "--prompts", str(tmp_path / "blank-prompt.jsonl")], "blank-prompt.jsonl:2: the prompt is empty"),
        (["ui", "--listen", "--auth", "user:secret"], "needs a page password and an API key: add --api-key auto (or drop"),
        (["train-head", "--prompts", str(prompts), "--out", "/proc/kestrel-head"], "--out /proc/kestrel-head/work"),
        (["bench", "--prompts", str(prompts), "--modes", "vanilla,vanilla"], "--modes names vanilla more than once"),
        (["bench", "--prompts", str(prompts), "--limit", "0"], "--limit: must be at least 1"),
        (["bench", "--prompts", str(prompts), "--modes", "vanilla,llama.cpp"], "mode llama.cpp needs --llama-python"),
        (["bench", "--prompts", str(prompts), "--json", str(tmp_path)], "is a folder; name a file"),
        (["bench", "--prompts", str(prompts), "--json", str(prompts)], "is the file this command reads"),
        (["bench", "--prompts", str(tmp_path)], "is a folder, not a prompt file"),
        (["train-head", "--prompts", str(prompts), "--out", str(prompts)], "--out"),
        (["train-head", "--prompts", str(tmp_path / "string-turns.jsonl"), "--out", str(tmp_path / "o")], "string-turns.jsonl:1: needs a 'turns' list"),
        (["train-head", "--prompts", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o")], "empty.jsonl: no prompts"),
        (["train-head", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--epochs", "0"], "--epochs: must be at least 1"),
        (["train-head", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--answer-temperature", "0"], "--answer-temperature: must be a number above 0"),
        (["train-head", "--prompts", str(tmp_path / "surrogate.jsonl"), "--out", str(tmp_path / "o")],
         "surrogate.jsonl:1: its turn 1 is not UTF-8 text (a lone surrogate \\ud800 at character 4"),
        (["eval-heads", "--features", str(tmp_path), "--steps", "0"], "--steps: must be at least 1"),
        (["eval-heads", "--features", str(tmp_path / "features"), "--split", "train", str(ROOT / "assets" / "heads" / "SmolLM2-135M-Instruct"),
          str(tmp_path / "features")], "features: no config.json"),  # a later head that is no head: before the model loads
    ]  # fmt: skip
    for argv, message in cases:
        try:
            code = cli.main(argv)
        except SystemExit as exit_info:  # argparse's own refusals
            code = exit_info.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists()  # a refused training run leaves no work folder behind


def test_chat_writes_the_reply_to_stdout_and_progress_to_stderr(tiny_dir, capsys):
    """`chat ... > reply.txt` keeps the reply and its statistics line; Kestrel's
    progress messages ("Compiling the model...") go to stderr."""
    import logging

    from app import cli

    kestrel = logging.getLogger("kestrel")
    handlers = list(kestrel.handlers)
    try:
        code = cli.main(["chat", "w1 w2", "--model", str(tiny_dir), "--dtype", "float32", "--compile", "off",
                         "--threads", "1", "--max-new-tokens", "4"])  # fmt: skip
        kestrel.info("a progress message")
    finally:
        for handler in set(kestrel.handlers) - set(handlers):
            kestrel.removeHandler(handler)
    captured = capsys.readouterr()
    assert code == 0 and "[vanilla] 4 tokens" in captured.err and "tokens" not in captured.out  # the reply alone on stdout
    assert "a progress message" in captured.err and "a progress message" not in captured.out


def test_chat_from_stdin_names_bytes_that_are_not_utf_8_and_a_closed_stdin(capsys, monkeypatch):
    """A strict UTF-8 locale's stdin raised the codec's own error, and a closed
    stdin a traceback: both are said as check_text says a prompt's problem."""
    import io

    from app import cli

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"w1 \xe9 w2"), encoding="utf-8", errors="strict"))
    refusals(cli, [(["chat", "-"], "the prompt is not UTF-8 text (byte 0xe9 at character 3)")], capsys)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"w1\r\nw2\r\n")))
    assert cli.read_stdin() == "w1\nw2\n"  # line ends as Windows' sys.stdin.read() gave them
    monkeypatch.setattr("sys.stdin", None)
    refusals(cli, [(["chat", "-"], "the prompt is - (standard input), and there is none")], capsys)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal(" "))  # typed at a terminal: how to end it is said first
    refusals(cli, [(["chat", "-"], "the prompt is empty")], capsys)
    monkeypatch.setattr("sys.stdin", Terminal(" "))
    cli.main(["chat", "-"])
    assert "then end it with Ctrl+" in capsys.readouterr().err


def test_chat_warms_up_on_built_in_prompts_before_the_timed_reply(tiny_dir, capsys, monkeypatch):
    """bench-app set a new process's first reply (nothing learnt, nothing
    allocated) beside a warm server's: `chat --warmup N` answers N built-in
    prompts untimed first, and the reply itself is unchanged."""
    from app import cli
    from core.bench import WARMUP_PROMPTS
    from core.engine import Engine

    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "6"]
    asked, chat = [], Engine.chat
    monkeypatch.setattr(Engine, "chat", lambda self, messages, **kwargs: asked.append(messages[-1]["content"]) or chat(self, messages, **kwargs))
    reply = cli_reply(cli, ["chat", "w1 w2", *options], capsys)
    assert asked == ["w1 w2"]
    assert cli_reply(cli, ["chat", "w1 w2", *options, "--warmup", "2"], capsys) == reply
    assert asked[1:] == [*WARMUP_PROMPTS[:2], "w1 w2"]


def test_chat_reads_the_prompt_from_stdin_and_names_the_seed_it_drew(tiny_dir, capsys, monkeypatch):
    """`chat -` takes the message from standard input; a sampled reply without
    --seed names the seed it drew, and --seed with it writes the same reply."""
    import io

    from app import cli

    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "6"]
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2\n"))
    assert cli.main(["chat", "-", *options]) == 0
    first = capsys.readouterr().out  # the reply alone: the statistics line (with its timings) goes to stderr
    assert first.strip() and "tokens/s" not in first and first == cli_reply(cli, ["chat", "w1 w2\n", *options], capsys)
    assert cli.main(["chat", "w1 w2", *options, "--temperature", "1"]) == 0
    sampled = capsys.readouterr()
    seed = int(sampled.err.split(", seed ")[1].split(",")[0])
    assert cli.main(["chat", "w1 w2", *options, "--temperature", "1", "--seed", str(seed)]) == 0
    again = capsys.readouterr()
    assert again.out == sampled.out and f"seed {seed}, finished" in again.err
    assert cli.main(["chat", "w1 w2", *options, "--temperature", "1", "--seed", "-1"]) == 0
    drawn = capsys.readouterr().err
    assert ", seed -1," not in drawn and int(drawn.split(", seed ")[1].split(",")[0]) >= 0  # -1 draws one, as in the API


def test_chat_takes_top_k_minus_one_as_the_api_does(tiny_dir, capsys):
    """The README says chat takes the API's settings with the same ranges; the
    API takes top_k -1 (vLLM's off) and chat refused it."""
    from app import cli

    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "6",
               "--temperature", "1", "--seed", "3"]  # fmt: skip
    assert cli.build_parser().parse_args(["chat", "hi", "--top-k", "-1"]).top_k == 0
    assert cli_reply(cli, ["chat", "w1 w2", *options, "--top-k", "-1"], capsys) == cli_reply(cli, ["chat", "w1 w2", *options, "--top-k", "0"], capsys)
    with pytest.raises(SystemExit):
        cli.main(["chat", "--help"])
    assert "(default 0 = off, as -1 is, which the API takes too;" in " ".join(capsys.readouterr().out.split())


def test_chat_names_the_sampling_settings_the_model_recommends(tiny_dir, tmp_path, capsys):
    """chat stays greedy without --temperature, but it said nothing of a
    model's recommended settings (Qwen3's temperature 0.6), which the API
    takes and the page names: a note on stderr names them and the options."""
    from app import cli

    folder = tmp_path / "recommends"
    shutil.copytree(tiny_dir, folder)
    written = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "eos_token_id": 4}
    (folder / "generation_config.json").write_text(json.dumps(written))
    options = ["--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "4"]
    greedy = cli_reply(cli, ["chat", "w1 w2", "--model", str(tiny_dir), *options], capsys)
    assert cli.main(["chat", "w1 w2", "--model", str(folder), *options]) == 0
    captured = capsys.readouterr()
    assert captured.out == greedy  # not taken silently: still greedy
    assert ("note: the model recommends sampling with temperature 0.6, top_p 0.95, top_k 20 (its generation_config.json); this reply "
            "is greedy (--temperature 0, the default): add --temperature 0.6 --top-p 0.95 --top-k 20") in captured.err  # fmt: skip
    assert cli.main(["chat", "w1 w2", "--model", str(folder), *options, "--temperature", "0"]) == 0
    assert "recommends" not in capsys.readouterr().err  # asked for by name
    assert cli.main(["chat", "w1 w2", "--model", str(tiny_dir), *options]) == 0
    assert "recommends" not in capsys.readouterr().err  # the tiny model recommends nothing
    # Gemma 3's: sampling with top_k and top_p, the temperature left at transformers' default (1), so not written
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 0.95, "top_k": 64, "eos_token_id": 4}))
    assert cli.main(["chat", "w1 w2", "--model", str(folder), *options]) == 0
    assert "add --temperature 1 --top-p 0.95 --top-k 64 to sample" in capsys.readouterr().err  # without it, still greedy


def test_chat_into_a_closed_pipe_ends_quietly(tiny_dir):
    """`chat ... | head`: the reader goes away, and chat ends with no error
    line and no traceback (exit 1, as Python advises for a broken pipe)."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE
    try:
        options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "6"]
        result = subprocess.run([sys.executable, str(ROOT / "launch.py"), "chat", "w1 w2", *options], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    finally:
        os.close(write_end)
    assert result.returncode == 1 and "Broken pipe" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_chat_in_vanilla_mode_loads_no_head(tiny_dir, capsys, monkeypatch):
    """`chat --mode vanilla` decodes with the base model alone: the head is
    neither loaded nor compiled, which saves seconds at every start."""
    from app import cli, session

    loaded = []
    monkeypatch.setattr(session, "load_draft_head", lambda base, source, dtype=None: loaded.append(source))
    monkeypatch.setattr(session, "default_head", lambda model: "some head")
    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "3"]
    assert cli.main(["chat", "w1 w2", *options, "--mode", "vanilla"]) == 0
    assert "[vanilla] 3 tokens" in capsys.readouterr().err
    assert loaded == []
    # a --head given with it is not loaded, so not checked: said, rather than seeming to be used
    assert cli.main(["chat", "w1 w2", *options, "--mode", "vanilla", "--head", "/no/such/head"]) == 0
    assert "--head /no/such/head is not loaded" in capsys.readouterr().err
    assert loaded == []


def test_chat_says_what_to_shorten_and_when_the_window_cuts_the_reply(tiny_dir, tmp_path, capsys, monkeypatch):
    """A prompt past the context window (256 tokens here) was refused as "the
    prompt is N tokens" alone, after the step costs were measured; one that left
    the reply less room than --max-new-tokens ended in "finished: context" alone."""
    from app import cli, session
    from models.base import load_base
    from models.head import save_head
    from tests.factory import random_head

    save_head(random_head(load_base(str(tiny_dir), dtype="float32").model), tmp_path / "head")
    monkeypatch.setattr(session, "prepare_costs", lambda engine: pytest.fail("measured before the prompt was checked"))
    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--mode", "eagle2", "--head", str(tmp_path / "head")]
    assert cli.main(["chat", " ".join(["w1"] * 300), *options]) == 2
    err = capsys.readouterr().err
    assert "the model's context window is 256: shorten the prompt by at least" in err and "tokens, and more to leave room" in err, err
    assert cli.main(["chat", " ".join(["w1"] * 150), "--system", " ".join(["w2"] * 150), *options]) == 2
    assert "shorten the prompt or --system by at least" in capsys.readouterr().err
    options = [*options[:-4], "--mode", "vanilla", "--max-new-tokens", "100"]
    assert cli.main(["chat", " ".join(["w1"] * 240), *options]) == 0
    err = capsys.readouterr().err
    assert "the reply can be" in err and "not --max-new-tokens 100" in err, err
    assert "finished: context (the reply reached the model's context window)" in err, err


def test_chat_says_when_a_fixed_tree_is_more_than_depth_and_top_k_can_draft(tiny_dir, capsys):
    from app import cli

    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1", "--max-new-tokens", "3"]
    assert cli.main(["chat", "w1 w2", *options, "--total-tokens", "40", "--depth", "3", "--tree-top-k", "3"]) == 0
    assert "Note: --total-tokens 40 is more than --depth 3 and --tree-top-k 3 can draft: trees hold at most 22 tokens" in capsys.readouterr().err
    assert cli.main(["chat", "w1 w2", *options, "--total-tokens", "22", "--depth", "3", "--tree-top-k", "3"]) == 0
    assert "Note:" not in capsys.readouterr().err


def test_ctrl_c_while_decoding_stops_the_reply_or_the_bench_with_what_it_has(tiny_dir, tmp_path, capsys, monkeypatch):
    """Ctrl+C during `chat` or `bench` stops the decoding within a step instead of
    raising where it lands (inside a compiled layer's kernel that was a RuntimeError
    traceback): chat keeps the reply so far and its statistics line, bench prints and
    writes the prompts it finished; both exit with 130. A second Ctrl+C raises at once."""
    import json
    import os
    import signal

    from app import cli
    from core.engine import Engine

    stream = Engine.stream
    calls = {"made": 0, "interrupted": 1}  # Ctrl+C as the third step of this call's reply is made

    def interrupted_stream(self, *args, **kwargs):
        calls["made"] += 1
        for number, step in enumerate(stream(self, *args, **kwargs), 1):
            if number == 3 and calls["made"] == calls["interrupted"]:
                os.kill(os.getpid(), signal.SIGINT)
            yield step

    monkeypatch.setattr(Engine, "stream", interrupted_stream)
    options = ["--model", str(tiny_dir), "--dtype", "float32", "--compile", "off", "--threads", "1"]
    assert cli.main(["chat", "w1 w2", *options, "--max-new-tokens", "12", "--mode", "vanilla"]) == 130
    err = capsys.readouterr().err
    assert "[vanilla] 3 tokens" in err and "finished: cancelled" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [f"w{i} w2"]}) + "\n" for i in range(3)))
    calls.update(made=0, interrupted=3)  # the warm-up's reply, the first prompt's, then the second prompt's
    argv = ["bench", "--prompts", str(prompts), "--modes", "vanilla", "--warmup", "1", "--max-new-tokens", "6",
            "--json", str(tmp_path / "r.json"), *options]  # fmt: skip
    assert cli.main(argv) == 130
    captured = capsys.readouterr()
    assert "vanilla" in captured.out and "(the prompts finished before the interrupt)" in captured.out
    assert "interrupted" in captured.err and "Traceback" not in captured.err
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["complete"] is False and [row["id"] for row in written["prompts"]] == ["0"]
    calls.update(made=0, interrupted=1)  # in the warm-up, before any prompt is measured: nothing to print, no traceback
    argv[argv.index("--modes") + 1] = "vanilla,generate"
    assert cli.main(argv) == 130
    captured = capsys.readouterr()
    assert "generate" not in captured.out and "interrupted" in captured.err and "Traceback" not in captured.err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl+C raises again after the command
    with pytest.raises(KeyboardInterrupt), cli.stop_on_interrupt() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5)
        os.kill(os.getpid(), signal.SIGINT)  # the second one
        time.sleep(5)


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGTERM handler to take a kill on Windows")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the interrupt Python dropped, as it reports it
def test_a_kill_whose_interrupt_python_dropped_in_a_finalizer_still_stops_the_bench(tiny_dir, tmp_path, capsys, monkeypatch):
    """A kill at start, while imports and the model's load run finalizers: the
    KeyboardInterrupt raised where it landed, in a finalizer, was only reported
    ("Exception ignored in"), and the whole benchmark ran on, ending 0."""
    import json
    import os
    import signal

    from app import cli

    monkeypatch.setattr(cli, "SIGNALLED", [])
    load = cli.load_engine

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, inside the finalizer

    def loaded_then_killed(*args, **kwargs):
        engine = load(*args, **kwargs)
        Finalized()
        return engine

    monkeypatch.setattr(cli, "load_engine", loaded_then_killed)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "turns": [f"w{i} w2"]}) + "\n" for i in range(3)))
    argv = ["bench", "--prompts", str(prompts), "--modes", "vanilla", "--max-new-tokens", "6", "--model", str(tiny_dir),
            "--dtype", "float32", "--compile", "off", "--threads", "1"]  # fmt: skip
    try:
        assert cli.main(argv) == 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert "interrupted" in capsys.readouterr().err and cli.SIGNALLED == [signal.SIGTERM]


def cli_reply(cli, argv: list[str], capsys) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_a_second_start_waits_for_the_first_one_s_setup(monkeypatch, tmp_path, capsys):
    """Two starts while .venv is being made (a double-click, then another):
    the second waits for the first instead of installing into the same .venv."""
    monkeypatch.setattr(launch, "LOCK", tmp_path / "setup.lock")
    entered = threading.Event()

    def second_start():
        with launch.setup_lock():
            entered.set()

    with launch.setup_lock():
        waiting = threading.Thread(target=second_start)
        waiting.start()
        assert not entered.wait(1.5)
    assert entered.wait(5)
    waiting.join()
    assert "waiting for it to finish" in capsys.readouterr().out


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGTERM or SIGHUP to send on Windows")
@pytest.mark.parametrize("signal_name, nohup", [("SIGTERM", False), ("SIGHUP", False), ("SIGHUP", True)])
def test_the_page_stops_on_sigterm_and_sighup_as_on_ctrl_c(tiny_dir, tmp_path, signal_name, nohup):
    """Logout, shutdown or a closed terminal stop the server the way Ctrl+C
    does (which saves the replies being written), instead of killing it; the
    stream an open page holds is cut without a traceback in the terminal.
    Started with nohup (SIGHUP ignored), it keeps running past a SIGHUP."""
    import os
    import signal

    import httpx

    # PYTHONFAULTHANDLER: a server that does not stop is sent SIGABRT below, which prints every thread's stack
    environment = {**os.environ, "KESTREL_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, str(ROOT / "launch.py"), "ui", "--model", str(tiny_dir), "--dtype", "float32",
               "--compile", "off", "--threads", "1", "--no-browser", "--port", "7931"]  # fmt: skip
    # the child's SIGHUP set either way: a test run started under nohup would hand its children SIGHUP ignored
    hangup = signal.SIG_IGN if nohup else signal.SIG_DFL
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))  # fmt: skip
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "Press Ctrl+C to stop" in line:
                break
        assert any("Press Ctrl+C to stop" in line for line in lines), "".join(lines)
        url = lines[-1].split(" at ")[1].split()[0]
        page = threading.Thread(target=hold_open, args=(httpx, f"{url}gradio_api/heartbeat/test"), daemon=True)
        page.start()
        time.sleep(1.0)
        server.send_signal(getattr(signal, signal_name))
        if nohup:
            time.sleep(2.0)
            assert server.poll() is None and httpx.get(f"{url}health").status_code == 200
            server.send_signal(signal.SIGTERM)
        try:
            rest, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.send_signal(signal.SIGABRT)
            pytest.fail(f"the server did not stop within 60 s of {signal_name}; its output and stacks:\n" + "".join(lines)
                        + server.communicate(timeout=30)[0])  # fmt: skip
    finally:
        server.kill()
    assert server.returncode == 0, "".join(lines) + rest
    assert "Stopping..." in rest and "Traceback" not in rest and "ERROR" not in rest, rest


def hold_open(httpx, url: str) -> None:
    """An open page's heartbeat stream, read until the server cuts it."""
    try:
        with httpx.stream("GET", url, timeout=60) as response:
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def test_the_chat_command_says_when_a_reply_ends_without_text(tiny_dir, monkeypatch, capsys):
    from app import cli
    from app.session import load_pair

    def ends_at_once(*args, **kwargs):
        engine = load_pair(str(tiny_dir), None, "none", "float64", "cpu", "off", False)
        first = next(iter(engine.chat([{"role": "user", "content": "w1"}], "vanilla"))).token_ids[0]
        engine.stop_ids = engine.stop_ids | {first}  # the reply's first token ends it
        return engine

    monkeypatch.setattr(cli, "load_engine", ends_at_once)
    assert cli.main(["chat", "w1", "--model", str(tiny_dir), "--mode", "vanilla", "--max-new-tokens", "4"]) == 0
    assert "note: the model ended its reply without writing anything" in capsys.readouterr().err


def test_a_failed_setup_lets_the_next_start_in_while_its_window_waits_for_enter(monkeypatch, tmp_path, capsys):
    """A first start that fails in a window that waits for Enter (a double-click,
    the Linux shortcut) has let go of the setup lock by then: a start made
    while that window stays open sets up instead of waiting for it."""
    monkeypatch.setattr(launch, "LOCK", tmp_path / "setup.lock")
    monkeypatch.setattr(launch, "setup_needed", lambda: True)
    monkeypatch.setattr(launch, "set_up", lambda: launch.fail("the package index cannot be reached", "connect to the internet"))
    monkeypatch.setenv(launch.SHORTCUT, "1")
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    free = []

    def press_enter(prompt):  # a second start, made while this window waits
        with open(launch.LOCK, "a+") as other:
            free.append(launch._try_lock(other))

    monkeypatch.setattr("builtins.input", press_enter)
    with pytest.raises(SystemExit) as exit_info:
        launch.main()
    assert exit_info.value.code == 1 and free == [True]
    assert "Kestrel could not start: the package index cannot be reached" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX's")
def test_a_folder_that_takes_no_locks_is_named_instead_of_read_as_held(monkeypatch, tmp_path, capsys):
    """Where the file system takes no locks (NFS without its lock service:
    ENOLCK), setup goes on without one, saying so, instead of waiting for a
    start that does not exist; the data folder names the problem and the way
    out instead of saying that Kestrel is already running. A lock another
    process holds (EWOULDBLOCK) is still waited for, or refused."""
    import errno
    import fcntl

    from app.instance import DataLock, FolderLockError

    def flock(fd, operation, error=errno.ENOLCK):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(launch, "LOCK", tmp_path / "setup.lock")
    entered = threading.Event()

    def start():
        with launch.setup_lock():
            entered.set()

    threading.Thread(target=start, daemon=True).start()
    assert entered.wait(5), "setup waited for a lock that no process holds"
    out = capsys.readouterr().out
    assert f"files in {launch.ROOT} cannot be locked (No locks available)" in out and "waiting" not in out
    with pytest.raises(FolderLockError) as error_info:
        DataLock(tmp_path / "data").acquire()
    said = str(error_info.value)
    assert f"{tmp_path / 'data'}: files there cannot be locked (No locks available)" in said and "KESTREL_DATA_DIR" in said
    monkeypatch.setattr(fcntl, "flock", lambda fd, operation: flock(fd, operation, errno.EWOULDBLOCK))
    assert not DataLock(tmp_path / "data").acquire()
    with open(launch.LOCK, "a+") as handle:
        assert launch._try_lock(handle) is False


def test_pip_fails_instead_of_waiting_for_a_login_it_cannot_show(monkeypatch):
    """pip's lines are read from a pipe, whole: a prompt for an index's login
    ("User for host: ") would never show, and the install would wait for good."""
    commands = []

    class Pip:
        def __init__(self, command, **kwargs):
            commands.append(command)
            self.stdout = iter(["Successfully installed x\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", Pip)
    launch.run_pip(["-r", "requirements.txt"], "installing requirements.txt")
    assert len(commands) == 1 and commands[0][2:4] == ["pip", "install"] and "--no-input" in commands[0]


SSL_LINE = ("Could not fetch URL https://pypi.org/simple/torch/: There was a problem confirming the ssl certificate: "
            "HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded with url: /simple/torch/ (Caused by "
            "SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
            "unable to get local issuer certificate (_ssl.c:1006)'))) - skipping")  # fmt: skip
PROXY_LINE = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by "
              "'ProxyError('Cannot connect to proxy.', OSError('Tunnel connection failed: 407 Proxy Authentication Required'))': /simple/torch/")  # fmt: skip
OFFLINE_LINE = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection broken by "
                "'NewConnectionError('<HTTPSConnection object>: Failed to establish a new connection: [Errno -3] "
                "Temporary failure in name resolution')': /simple/torch/")  # fmt: skip


@pytest.mark.parametrize(
    ("said", "cause", "fix"),
    [
        (SSL_LINE, f"the package index's certificate is not trusted here ({SSL_LINE.strip()})", "set PIP_CERT"),
        (PROXY_LINE, f"the proxy did not let pip through ({PROXY_LINE})", "check the proxy settings"),
        (OFFLINE_LINE, f"the package index cannot be reached ({OFFLINE_LINE})", "connect to the internet and run launch.py again"),
    ],
)
def test_a_pip_failure_names_its_cause_with_pip_s_line(monkeypatch, capsys, said, cause, fix):
    """A proxy or antivirus that inspects HTTPS makes pip say "Could not fetch URL",
    as it does offline: told to connect to the internet while online, without the
    line that says why. Offline, the fix holds after an update too, not only on a first run."""

    class Pip:
        def __init__(self, command, **kwargs):
            self.stdout = iter(["Collecting torch==2.13.0\n", f"{said}\n", "ERROR: No matching distribution found for torch==2.13.0\n"])

        def wait(self):
            return 1

    monkeypatch.setattr(launch.subprocess, "Popen", Pip)
    with pytest.raises(SystemExit):
        launch.run_pip(["-r", "requirements.txt"], "installing requirements.txt")
    err = capsys.readouterr().err
    assert f"Kestrel could not start: installing requirements.txt: {cause}" in err and fix in err and "first run" not in err


def test_a_venv_that_cannot_be_made_says_what_venv_said_on_stdout_or_of_the_folder_s_path(monkeypatch, tmp_path, capsys):
    """Debian and Ubuntu print the package that venv needs on stdout, which was
    dropped (leaving a generic python3-venv, wrong for a python3.X of its own); a
    folder whose path holds the PATH separator (':', ';' on Windows) is to be moved
    or renamed, not fixed by installing a venv module."""
    debian = ("The virtual environment was not created successfully because ensurepip is not\navailable.  On Debian/Ubuntu "
              "systems, you need to install the python3-venv\npackage using the following command.\n\n    apt install "
              "python3.12-venv\n\nYou may need to use sudo with that command.\n\nFailing command: /x/.venv/bin/python3.12\n")  # fmt: skip
    monkeypatch.setattr(launch, "VENV", tmp_path / ".venv")
    monkeypatch.setattr(launch, "STAMP", tmp_path / ".venv" / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "in_venv", lambda: False)

    def venv(command, **kwargs):
        raise subprocess.CalledProcessError(1, command, output=debian, stderr="")

    monkeypatch.setattr(launch.subprocess, "run", venv)
    with pytest.raises(SystemExit):
        launch.set_up()
    err = capsys.readouterr().err
    assert "Fix: install Python's venv module (apt install python3.12-venv, with sudo)" in err and "python3-venv" not in err
    fix = launch.venv_fix("Error: Refusing to create a venv in /tmp/AI:ML/.venv because it contains the PATH separator :.")
    assert "rename the folder in its path" in fix and "':'" in fix and "Finder" in fix and "venv module" not in fix
    fix = launch.venv_fix("Error: Refusing to create a venv in C:\\AI;ML\\.venv because it contains the PATH separator ;.")
    assert "rename the folder in its path" in fix and "';'" in fix and "Finder" not in fix


@pytest.mark.skipif(sys.platform == "win32", reason="a link needs administrator rights or developer mode on Windows")
def test_a_venv_that_is_a_link_or_cannot_be_removed_or_stamped_is_said_without_a_traceback(monkeypatch, tmp_path, capsys):
    """A .venv linked to another disk whose Python is gone raised "Cannot call
    rmtree on a symbolic link" at every start: what the link points to is left
    alone, and made again in once emptied. A .venv that cannot be removed (a
    file held on Windows) and a stamp that cannot be written are one cause and one fix."""
    target = tmp_path / "disk" / "venv"
    target.mkdir(parents=True)
    (target / "pyvenv.cfg").write_text("home = /a/python/that/is/gone\n")
    venv = tmp_path / ".venv"
    venv.symlink_to(target)
    monkeypatch.setattr(launch, "VENV", venv)
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "in_venv", lambda: False)
    monkeypatch.setattr(launch, "run_pip", lambda args, step: None)
    real_run = subprocess.run

    def fake_venv(command, **kwargs):  # `python -m venv DIR`: a working one, linked to this Python
        if command[1:3] != ["-m", "venv"]:
            return real_run(command, **kwargs)
        launch.venv_python().parent.mkdir(parents=True)
        launch.venv_python().symlink_to(Path(sys.executable).resolve())
        (launch.VENV / "pyvenv.cfg").touch()

    monkeypatch.setattr(launch.subprocess, "run", fake_venv)
    with pytest.raises(SystemExit):
        launch.set_up()
    err = capsys.readouterr().err
    assert f"Kestrel could not start: .venv is a link to {target}" in err and f"empty the folder {target}" in err
    assert venv.is_symlink() and (target / "pyvenv.cfg").exists()
    (target / "pyvenv.cfg").unlink()
    launch.set_up()  # emptied: made again inside it
    assert venv.is_symlink() and (target / "bin" / "python").exists() and not launch.stamp_stale()

    monkeypatch.setattr(launch, "STAMP", tmp_path / "disk" / "pyvenv.cfg" / "stamp")  # a file where its folder belongs
    (tmp_path / "disk" / "pyvenv.cfg").write_text("")
    with pytest.raises(SystemExit):
        launch.set_up()
    assert f"the packages are installed, but {launch.STAMP} cannot be written" in capsys.readouterr().err

    venv.unlink()
    venv.mkdir()
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")

    def held(path, *args, **kwargs):
        raise PermissionError(13, "Access is denied", str(path))

    monkeypatch.setattr(launch.shutil, "rmtree", held)
    with pytest.raises(SystemExit):
        launch.set_up()
    assert f".venv cannot be removed to be made again ([Errno 13] Access is denied: '{venv}')" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="a link needs administrator rights or developer mode on Windows")
def test_a_venv_whose_python_a_system_upgrade_changed_is_made_again(monkeypatch, tmp_path, capsys):
    """.venv's python links to the unversioned /usr/bin/python3, which an OS upgrade
    points at a newer Python: that one found none of the packages (installed for the
    old one), and every start stopped with "No module named 'platformdirs'" instead
    of making .venv again, for its stamp was up to date."""
    system = tmp_path / "usr" / "bin"
    system.mkdir(parents=True)
    (system / "python3.12").write_text("#!/bin/sh\nexit 1\n")
    (system / "python3").symlink_to("python3.12")  # was python3.11 until the upgrade
    venv = tmp_path / ".venv"
    monkeypatch.setattr(launch, "VENV", venv)
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "in_venv", lambda: False)
    monkeypatch.setattr(launch, "run_pip", lambda args, step: None)

    def made_by(version):  # what `python3 -m venv .venv` leaves
        launch.venv_python().parent.mkdir(parents=True)
        launch.venv_python().symlink_to(system / "python3")
        (venv / "pyvenv.cfg").write_text(f"home = {system}\nversion = {version}\n")
        launch.STAMP.write_text(launch.wanted_stamp())

    made_by("3.11.7")
    assert launch.setup_needed()
    real_run = subprocess.run

    def fake_venv(command, **kwargs):
        if command[1:3] != ["-m", "venv"]:
            return real_run(command, **kwargs)
        made_by("3.12.1")

    monkeypatch.setattr(launch.subprocess, "run", fake_venv)
    launch.bootstrap()
    out = capsys.readouterr().out
    assert "cannot be used (its Python is now 3.12, not the 3.11 that made it): making it again" in out
    assert not launch.setup_needed()
    # virtualenv and uv write version_info; a Python whose file name holds no version (Windows' copy) is not judged
    assert launch.python_changed("home = /usr/bin\nversion_info = 3.11.7.final.0\n", "python3.12") is not None
    assert launch.python_changed("version = 3.12.1\n", "python3.12") is None
    assert launch.python_changed("version = 3.11.7\n", "python.exe") is None


def test_a_read_only_folder_whose_packages_are_installed_starts_with_a_note(monkeypatch, tmp_path, capsys):
    """A read-only Kestrel folder and a changed requirements.txt: pip found every
    package installed, then the stamp could not be written, and Kestrel refused
    to start, told to free some disk space."""
    venv = tmp_path / ".venv"
    monkeypatch.setattr(launch, "VENV", venv)
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "in_venv", lambda: False)
    monkeypatch.setattr(launch, "venv_problem", lambda: None)  # a working .venv
    monkeypatch.setattr(launch, "run_pip", lambda args, step: None)
    real_write = Path.write_text
    for code, said in ((errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied")):

        def read_only(path, *args, **kwargs):
            if path == launch.STAMP:
                raise OSError(code, said, str(path))
            return real_write(path, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", read_only)
        launch.set_up()
        err = capsys.readouterr().err
        assert f"the packages are installed, but {launch.STAMP} cannot be written ({said}): {venv} is read-only" in err
        assert "could not start" not in err and "disk space" not in err


def test_a_venv_without_pyvenv_cfg_is_not_run_again_and_again(monkeypatch, tmp_path, capsys):
    """Without pyvenv.cfg .venv's Python runs outside .venv: launch.py found .venv
    complete, exec'd itself with that Python, found itself outside .venv, and
    exec'd again, forever."""
    venv = tmp_path / ".venv"
    monkeypatch.setattr(launch, "VENV", venv)
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "LOCK", tmp_path / "setup.lock")
    monkeypatch.setattr(sys, "stdin", None)
    monkeypatch.delenv(launch.SHORTCUT, raising=False)
    launch.venv_python().parent.mkdir(parents=True)
    launch.venv_python().symlink_to(Path(sys.executable).resolve())
    launch.STAMP.write_text(launch.wanted_stamp())
    assert launch.setup_needed() and launch.venv_problem() == "its pyvenv.cfg cannot be read: No such file or directory"

    def execv(*args):
        raise AssertionError("launch.py exec'd itself again")

    monkeypatch.setattr(launch.os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["launch.py", "--help"])
    monkeypatch.setattr(sys, "executable", str(launch.venv_python()))  # the start that the first one exec'd
    with pytest.raises(SystemExit):
        launch.main()
    assert "Kestrel could not start: .venv is incomplete (its pyvenv.cfg cannot be read" in capsys.readouterr().err
    monkeypatch.setattr(launch, "bootstrap", lambda: None)  # whatever else keeps .venv's Python outside .venv
    with pytest.raises(SystemExit):
        launch.main()
    assert f"Kestrel could not start: {launch.venv_python()} runs outside .venv" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands for .venv's Python")
def test_a_half_installed_pip_is_no_working_pip(monkeypatch, tmp_path):
    """A pip cut short while it was installed (its package there, most of its
    modules not) passed the probe, `import pip`, and was never repaired: every
    install failed in it."""
    venv = tmp_path / ".venv"
    monkeypatch.setattr(launch, "VENV", venv)
    half = tmp_path / "half" / "pip"
    half.mkdir(parents=True)
    (half / "__init__.py").write_text("")
    python = launch.venv_python()
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{half.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / "pyvenv.cfg").touch()
    assert launch.venv_problem() == "it has no working pip"
    (half / "__init__.py").unlink()
    half.rmdir()
    assert launch.venv_problem() is None


@pytest.mark.skipif(sys.platform == "win32", reason="a link needs administrator rights or developer mode on Windows")
def test_a_venv_linked_to_a_missing_disk_or_that_is_a_file_is_said_so(monkeypatch, tmp_path, capsys):
    """.venv linked to a disk that is not mounted was told "[Errno 17] File exists"
    and to install the venv module; a .venv that is a file, that its Python is gone
    and to close the programs that use it."""
    target = tmp_path / "unmounted" / "venv"
    venv = tmp_path / ".venv"
    venv.symlink_to(target)
    monkeypatch.setattr(launch, "VENV", venv)
    monkeypatch.setattr(launch, "STAMP", venv / "kestrel-requirements.sha256")
    monkeypatch.setattr(launch, "in_venv", lambda: False)
    monkeypatch.setattr(sys, "stdin", None)
    made = []

    def venv_on_a_link_to_nothing(command, **kwargs):  # what `python -m venv .venv` says there
        made.append(command)
        raise subprocess.CalledProcessError(1, command, output="", stderr=f"Error: [Errno 17] File exists: '{venv}'")

    monkeypatch.setattr(launch.subprocess, "run", venv_on_a_link_to_nothing)
    with pytest.raises(SystemExit):
        launch.set_up()
    err = capsys.readouterr().err
    assert f"Kestrel could not start: .venv is a link to {target}, which does not exist" in err
    assert f"connect the disk that holds {target}, or delete the link .venv" in err and "venv module" not in err
    assert made == [] and venv.is_symlink() and not target.parent.exists()
    venv.unlink()
    venv.write_text("notes")
    with pytest.raises(SystemExit):
        launch.set_up()
    err = capsys.readouterr().err
    assert f"Kestrel could not start: {venv} is a file, not the folder of a virtual environment" in err
    assert "close the programs" not in err and venv.read_text() == "notes" and made == []


def test_python_2_is_told_the_python_kestrel_needs():
    """Python 2 reads the whole file before it runs a line of it, so its
    SyntaxError shows the line it stops at: that line says what to run instead."""
    python2 = shutil.which("python2")
    if python2 is None or subprocess.run([python2, "--version"], capture_output=True).returncode != 0:
        pytest.skip("no Python 2 here")
    result = subprocess.run([python2, str(ROOT / "launch.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Kestrel needs Python 3.11 to 3.14" in result.stderr


def test_a_wrong_python_is_told_the_command_that_runs_another_on_its_system(capsys):
    """Windows has no python3.11 command; its launcher takes the version: py -3.11."""
    for system, older, newer in (("win32", "py -3.11 launch.py", "py -3.14 launch.py"), ("linux", "python3.11 launch.py", "python3.14 launch.py")):
        with pytest.raises(SystemExit):
            launch.check_python((3, 10, 13), system)
        assert f"(e.g. {older})" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            launch.check_python((3, 15, 0), system)
        assert f"(e.g. {newer})" in capsys.readouterr().err
    assert launch.start_command("", "win32") == "py launch.py" and launch.start_command("", "darwin") == "python3 launch.py"


def refusals(cli, cases, capsys) -> None:
    """Each argv ends with exit code 2 and one line holding its message."""
    for argv, message in cases:
        code = cli.main(argv)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)


def test_a_results_file_is_never_a_file_the_command_reads(tmp_path, capsys, monkeypatch):
    """--json naming a head's, the features' or the model's file (or any file in
    their folders) is refused before any work: eval-heads and bench finished
    and wrote their figures over the head's config.json or weights."""
    import shutil

    from app import cli

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("app.session.load_pair", no_model)
    monkeypatch.setattr("models.base.load_base", no_model)
    bundled_head = ROOT / "assets" / "heads" / "SmolLM2-135M-Instruct"
    head, other, model = tmp_path / "head", tmp_path / "other", tmp_path / "model"
    for folder in (head, other):
        shutil.copytree(bundled_head, folder)
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    work = tmp_path / "work"
    (work / "features" / "eval").mkdir(parents=True)
    (work / "features" / "eval" / "shard-00000.safetensors").write_bytes(b"")
    (work / "base-model.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w1 w2"]}\n')
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    judge = ["eval-heads", "--features", str(work / "features"), "--head", str(head), str(other)]
    bench = ["bench", "--prompts", str(prompts), "--head", str(head)]
    refusals(cli, [
        ([*judge, "--json", str(head / "config.json")], f"would write over a file inside {head}, the --head folder this command reads"),
        ([*judge, "--json", str(other / "model.safetensors")], f"would write over a file inside {other}, the HEAD folder this command reads"),
        ([*judge, "--json", str(work / "features" / "eval" / "shard-00000.safetensors")], "the --features folder this command reads"),
        ([*judge, "--json", str(work / "base-model.json")], "is the file this command reads (the record of the base model beside --features)"),
        ([*judge, "--model", str(model), "--json", str(model / "config.json")], f"would write over a file inside {model}, the --model folder"),
        ([*bench, "--json", str(head / "model.safetensors")], f"would write over a file inside {head}, the --head folder this command reads"),
        ([*bench, "--model", str(tmp_path / "model.gguf"), "--json", str(tmp_path / "model.gguf")], "is the file this command reads (--model)"),
        ([*bench, "--other-head", f"x={other}", "--modes", "vanilla,eagle2@x", "--json", str(other / "config.json")],
         f"would write over a file inside {other}, the --other-head x folder this command reads"),
        ([*bench, "--json", str(prompts)], "is the file this command reads (--prompts)"),
    ], capsys)  # fmt: skip
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    # a new file beside a head's files overwrites nothing it reads
    assert cli.check_writable(str(head / "figures.json"), "--json", [("--head", head)]) == head / "figures.json"
    # the check leaves no folders behind: a mistyped path whose run then fails or is stopped made a tree of them
    assert cli.check_writable(str(tmp_path / "typo" / "deeper" / "r.json"), "--json") == tmp_path / "typo" / "deeper" / "r.json"
    assert not (tmp_path / "typo").exists()


def test_prompt_commands_refuse_an_out_that_is_or_holds_their_work_folder(tmp_path, capsys, monkeypatch):
    """self-prompts and long-prompts with --out the --work folder, or a folder
    above it, ran the whole job, then failed to write: [Errno 21] Is a directory."""
    from app import cli

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("models.base.load_base", no_model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w1 w2"]}\n')
    work = tmp_path / "w" / "cache"
    for command in ("self-prompts", "long-prompts"):
        for out, said in ((work, "is the --work folder"), (tmp_path / "w", "is a folder that holds the --work folder"),
                          (tmp_path, "is a folder that holds the --work folder")):  # fmt: skip
            argv = [command, "--prompts", str(prompts), "--out", str(out), "--work", str(work)]
            refusals(cli, [(argv, f"--out {out}: {said} {work}; name a JSONL file for the")], capsys)
    assert not (tmp_path / "w").exists()


def test_eval_heads_finds_the_work_folder_of_features_given_as_a_relative_path(tmp_path, capsys, monkeypatch):
    """`eval-heads --features .` inside the features folder read no record of
    the model its work folder made them with (Path('.').parent is '.'), and a
    split folder or a head folder given for --features was told to run train-head."""
    from app import cli

    loaded = []

    def load_base(model, quantization, *args):
        loaded.append(quantization)
        raise ValueError("stopped here")

    monkeypatch.setattr("models.base.load_base", load_base)
    work = tmp_path / "work"
    (work / "features" / "eval").mkdir(parents=True)
    (work / "features" / "eval" / "shard-00000.safetensors").write_bytes(b"")
    (work / "base-model.json").write_text(json.dumps({"name": "m", "quantization": "none", "sizes": [], "embedding": "x"}))
    head = ROOT / "assets" / "heads" / "SmolLM2-135M-Instruct"
    monkeypatch.chdir(work / "features")
    assert cli.main(["eval-heads", "--features", ".", "--head", str(head)]) == 2
    assert loaded == ["none"] and f"--quantization auto: none, as {work}'s answers and features were made" in capsys.readouterr().out
    refusals(cli, [
        (["eval-heads", "--features", "eval", "--head", str(head)],
         f"eval/eval: no feature shards; it holds the shards of one split: give the folder above it, --features {work / 'features'}"),
        (["eval-heads", "--features", str(head), "--head", str(head)], "it holds config.json: a head's (or a model's) folder, not features"),
    ], capsys)  # fmt: skip
    assert loaded == ["none"]
