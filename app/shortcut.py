"""`launch.py --install-shortcut`: a menu/desktop entry that starts Kestrel."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from launch import SHORTCUT  # set by the Linux entry, whose terminal closes when Kestrel ends

ROOT = Path(__file__).resolve().parent.parent
ICON = ROOT / "assets" / "kestrel.svg"


# Where Kestrel keeps its chats and its converted model: a shortcut made while
# these are set starts Kestrel with them (else it would find neither there).
MOVED_FOLDERS = ("KESTREL_DATA_DIR", "KESTREL_CACHE_DIR")


def moved_folders() -> list[tuple[str, str]]:
    """(name, full path) of each of MOVED_FOLDERS set now."""
    return [(name, str(Path(os.environ[name]).expanduser().resolve())) for name in MOVED_FOLDERS if os.environ.get(name)]


# The shortcuts run the Python that made .venv, or python3 where that is gone (a system upgrade
# removed python3.11): launch.py then checks its version and makes .venv again with it. Without
# this, a Linux shortcut's terminal closed at once, saying nothing. sh's $0: the Python named.
OR_PYTHON3 = 'if [ -x "$0" ]; then exec "$0" "$@"; fi; exec python3 "$@"'


def desktop_entry(root: Path, python: str, folders: list[tuple[str, str]] = (), options: list[str] = ()) -> str:
    """A freedesktop.org entry: Exec's arguments quoted (with \\ " ` $ escaped
    inside the quotes, and the whole line's backslashes and % doubled, as the
    specification asks of string values and field codes), other values with
    their backslashes doubled, so that any folder name starts Kestrel.
    `folders`: variables set for it, through env; `options`: launch.py's (shortcut_command)."""
    setting = "env " + "".join(f"{exec_argument(f'{name}={value}')} " for name, value in folders) if folders else ""
    given = "".join(f" {exec_argument(option)}" for option in shortcut_command(options))
    return "\n".join([
        "[Desktop Entry]",
        "Type=Application",
        "Name=Kestrel",
        "Comment=Local LLM chat with EAGLE-2 speculative decoding",
        f"Exec={setting}{' '.join(exec_argument(part) for part in ('/bin/sh', '-c', OR_PYTHON3, python, str(root / 'launch.py')))}{given}",
        f"Path={entry_value(str(root))}",
        f"Icon={entry_value(str(root / 'assets' / 'kestrel.svg'))}",
        "Terminal=true",
        "Categories=Utility;Development;",
        "",
    ])  # fmt: skip


def windows_batch(root: Path, python: str, folders: list[tuple[str, str]] = (), options: list[str] = ()) -> str:
    """cmd reads a batch file in the console's code page: switched to UTF-8
    first, so that a folder named with accents is found ('%' doubled: cmd
    expands it even in quotes). launch.py keeps the window open after a
    failure; the pause covers a Python that is gone (cmd's 9009)."""
    root_text, python_text = (str(path).replace("%", "%%") for path in (root, python))
    setting = [f'set "{name}={value.replace("%", "%%")}"' for name, value in folders]
    quoted = "".join(f' "{batch_argument(option)}"' for option in shortcut_command(options))
    lines = ["@echo off", "chcp 65001 >nul", *setting, f'cd /d "{root_text}"', f'"{python_text}" launch.py{quoted} %*', "if errorlevel 9009 pause", ""]
    return "\r\n".join(lines)


def shortcut_command(options: list[str]) -> list[str]:
    """launch.py's arguments for a shortcut made with `options`: none for the
    defaults (the shortcut's own arguments are then the page's options or a
    command), else the page's command and the options."""
    return ["ui", *options] if options else []


def batch_argument(text: str) -> str:
    """One argument of a batch file's command line, to be written in quotes:
    cmd has no escape for a quote inside quotes; backslashes ending it are
    doubled, since Windows reads a backslash before the closing quote as
    escaping it (D:\\ would run on into the next argument)."""
    if '"' in text:
        raise ValueError(f"{text!r}: a Windows shortcut cannot pass on an option with a double quote in it")
    trailing = len(text) - len(text.rstrip("\\"))
    return (text + "\\" * trailing).replace("%", "%%")


def exec_argument(text: str) -> str:
    """One argument of a desktop entry's Exec line (quoted, escaped within the
    quotes, then the line's own string escaping and % of field codes)."""
    quoted = '"' + "".join("\\" + c if c in '"`$\\' else c for c in text) + '"'
    return entry_value(quoted).replace("%", "%%")


def entry_value(text: str) -> str:
    """A desktop entry's string value: a backslash is written doubled (\\s would read as a space)."""
    return text.replace("\\", "\\\\")


def mac_command(root: Path, python: str, folders: list[tuple[str, str]] = (), options: list[str] = ()) -> str:
    """bash, with the paths in single quotes (nothing is expanded there; a ' is closed, escaped and reopened)."""
    setting = "".join(f"export {name}={shell_quoted(value)}\n" for name, value in folders)
    given = "".join(f"{shell_quoted(option)} " for option in shortcut_command(options))
    return (f"#!/bin/bash\n{setting}cd {shell_quoted(str(root))}\npython={shell_quoted(python)}\n"
            f'[ -x "$python" ] || python=python3  # the Python that made .venv is gone: launch.py makes it again\n'
            f'exec "$python" launch.py {given}"$@"\n')  # fmt: skip


def shell_quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def base_python() -> str:
    """The Python that made .venv (this process runs in it): the one that
    passed launch.py's version check, where plain `python3` may be older."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _write_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def windows_desktop() -> Path | None:
    """The user's Desktop folder as Windows knows it (OneDrive may have moved
    it from HOME\\Desktop), or None off Windows."""
    try:
        import ctypes

        buffer = ctypes.create_unicode_buffer(1024)
        if ctypes.windll.shell32.SHGetFolderPathW(None, 0x10, None, 0, buffer) == 0 and buffer.value:  # CSIDL_DESKTOPDIRECTORY
            return Path(buffer.value)
    except (AttributeError, ImportError, OSError):
        pass
    return None


def xdg_desktop(home: Path) -> Path:
    """The desktop folder that freedesktop's user-dirs.dirs names (a localised
    one such as ~/Schreibtisch), else ~/Desktop."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "user-dirs.dirs"
    try:
        lines = config.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        name, _, value = line.strip().partition("=")
        if name == "XDG_DESKTOP_DIR" and value:
            value = value.strip().strip('"').replace("$HOME", str(home))
            return Path(value) if Path(value).is_absolute() else home / value  # "$HOME/" (the home itself) turns the desktop off
    return home / "Desktop"


def install(root: Path = ROOT, platform: str = sys.platform, home: Path | None = None, options: list[str] = ()) -> list[Path]:
    """Write the shortcut(s) for this platform; returns the files written (on
    Linux the menu entry, and the desktop's where the desktop folder exists).
    options: the page's options the shortcut starts Kestrel with (cli.shortcut_options)."""
    known = windows_desktop() if home is None and platform.startswith("win") else None  # OneDrive may move it
    home = home or Path.home()
    desktop = known or (home / "Desktop" if platform.startswith("win") or platform == "darwin" else xdg_desktop(home))
    folders = moved_folders()
    if platform.startswith("win"):
        return [_write_executable(desktop / "Kestrel.bat", windows_batch(root, base_python(), folders, options))]
    if platform == "darwin":
        return [_write_executable(desktop / "Kestrel.command", mac_command(root, base_python(), folders, options))]
    entry = desktop_entry(root, base_python(), [(SHORTCUT, "1"), *folders], options)  # its terminal closes at the end: an error waits there
    data_home = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    written = [_write_executable(data_home / "applications" / "kestrel.desktop", entry)]
    if desktop.is_dir() and desktop.resolve() != home.resolve():
        written.append(_write_executable(desktop / "kestrel.desktop", entry))
    return written
