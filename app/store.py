"""Settings and chat history on disk, in the user data folder.

Every file is written atomically (temp file + fsync + os.replace), so a crash
or a full disk mid-write leaves the previous version intact."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Collection
from pathlib import Path

from app.render import inert_markdown, is_number
from models.paths import while_held

SETTINGS_FILE = "settings.json"
CHATS_FOLDER = "chats"
WINDOWS_DEVICE = re.compile(r"(CON|PRN|AUX|NUL|COM[0-9¹²³]|LPT[0-9¹²³])(\..*)?", re.IGNORECASE)  # names Windows keeps for devices
CHAT_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")  # as new_chat makes them: a safe file name everywhere
NAME_LIMIT = 100  # characters of a chat's name
LARGEST_COUNT = 2**53  # a chat's token and forward counts, at most (a float holds every int up to it)
LATEST_TIME = 32503680000.0  # 3000-01-01: Windows' localtime fails past 3000 (and NaN is no date anywhere)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair, which UTF-8 cannot encode
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how JSON text read as UTF-8 can hold one (or a pair)
# levels of lists and objects in a file read, at most: Kestrel's own files have fewer than 10, and a chat
# with a value nested some hundreds deep (valid JSON, which Python reads) fails every Send (copy.deepcopy
# exceeds Python's recursion limit)
NESTING_LIMIT = 64
# On Windows a file that another program holds open (a virus scanner or the
# search indexer reading the file just written) cannot be replaced for a moment.
REPLACE_TRIES = 6 if os.name == "nt" else 1


def write_atomic(path: Path, text: str, shared: bool = False) -> None:
    """Write `text` whole or not at all. The file is readable by its owner
    only (chats, settings), unless `shared` (results meant to be passed on):
    then as the user's umask makes new files."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:  # named by the file meant, not by the hidden temporary one
        raise OSError(error.errno, error.strerror, str(path)) from error
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if shared:
            os.chmod(temp, 0o666 & ~current_umask())
        replace(Path(temp), path)
    except BaseException as error:
        Path(temp).unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno is not None:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Sync `folder` after a file in it was replaced (POSIX): write_atomic syncs
    the file's data, but its new name is the folder's, which a power cut could
    lose otherwise. Where a folder cannot be opened or synced (Windows, some
    file systems), the name is written when the system writes it."""
    if os.name == "nt":
        return
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def well_formed(value):
    """A JSON value (text, list, object) with every lone UTF-16 surrogate in its
    texts replaced by U+FFFD, the character a browser shows for one: JSON's
    escapes and a browser's input can hold one (half an emoji), but it can be
    neither saved as UTF-8, nor tokenized, nor sent to the page."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [well_formed(item) for item in value]
    if isinstance(value, dict):
        return {well_formed(key): well_formed(item) for key, item in value.items()}
    return value


def remove_leftovers(folder: Path) -> None:
    """Remove the temporary files of writes cut short (a killed process) from
    `folder` and its chats: only while no other process writes there (held DataLock)."""
    for directory in (folder, folder / CHATS_FOLDER):
        for temp in directory.glob(".*.tmp") if directory.is_dir() else ():
            try:
                temp.unlink()
            except OSError:
                pass


def current_umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: put back at once
    os.umask(mask)
    return mask


def replace(source: Path, target: Path) -> None:
    """os.replace, tried again for a moment where another program holds the file (Windows)."""
    while_held(os.replace, source, target, REPLACE_TRIES)


def new_chat(system: str = "") -> dict:
    """A chat as stored: messages hold role and content; assistant messages
    also hold `segments` ([text, origin] pairs) and `stats` of their reply."""
    now = time.time()
    return {
        "id": time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6],
        "title": "",
        "created": now,
        "updated": now,
        "system": system,
        "messages": [],
        "session": {"tokens": 0, "forwards": 0},
    }


def clean_name(text: str) -> str:
    """A chat's name as kept: spaces and line breaks collapsed to single spaces."""
    return " ".join(text.split())


def kept_name(value) -> str | None:
    """A name read from a chat file, where it is one as Rename keeps it (a
    text, not empty, its spaces collapsed); None for anything else (a file
    edited by hand), which gives the chat its first message's title."""
    return value if isinstance(value, str) and value and value == clean_name(value) and len(value) <= NAME_LIMIT else None


def chat_title(chat: dict) -> str:
    """The name the user gave the chat, else its first message, shortened; a
    chat that another tab's change split off is marked a copy."""
    if chat.get("name"):
        title = chat["name"]
    else:
        first = next((m["content"] for m in chat["messages"] if m["role"] == "user"), "")
        title = " ".join(first.split())
        title = (title[:48] + "...") if len(title) > 48 else (title or "New chat")
    return f"{title} (copy)" if chat.get("copy_of") else title


class Store:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.settings_lock = threading.Lock()  # the page's settings and the Models tab's choice are saved from other threads
        self.set_aside: str | None = None  # a damaged settings file a change set aside, until a page load has said so

    def load_settings(self) -> dict:
        return self.read_object(self.folder / SETTINGS_FILE) or {}

    def set_aside_damaged_settings(self) -> str | None:
        """A settings file that holds no JSON object is renamed, so that the
        next change saved does not replace it: its new name (or its name,
        where it cannot be renamed); None when the file is fine, missing or
        cannot be read just now (which is not damage)."""
        path = self.folder / SETTINGS_FILE
        try:
            if not path.exists() or self._parse(path) is not None:
                return None
        except OSError:
            return None
        kept = path.with_name(time.strftime("settings.damaged-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4] + ".json")
        try:
            replace(path, kept)
        except OSError:
            return path.name
        return kept.name

    def write_problem(self) -> str | None:
        """Why chats and settings cannot be saved here, where that shows before
        a save (a file where a folder belongs, a folder that cannot be written); None otherwise."""
        chats, settings = self.folder / CHATS_FOLDER, self.folder / SETTINGS_FILE
        for path in (self.folder, chats):
            if path.exists() and not path.is_dir():
                return f"{path} is a file, not a folder"
        if settings.is_dir():
            return f"{settings} is a folder, not a file"
        for path in (chats, self.folder):
            if path.is_dir():
                return None if os.access(path, os.W_OK) else f"{path} cannot be written"
        # not made yet (a new KESTREL_DATA_DIR): the first save makes it in the nearest folder that exists
        nearest = next(parent for parent in self.folder.absolute().parents if parent.exists())  # the root at least
        if not nearest.is_dir():
            return f"{self.folder} cannot be made ({nearest} is not a folder)"
        return None if os.access(nearest, os.W_OK) else f"{self.folder} cannot be made ({nearest} cannot be written)"

    def save_settings(self, settings: dict) -> None:
        write_atomic(self.folder / SETTINGS_FILE, json.dumps(settings, indent=2))

    def update_settings(self, changes: dict) -> None:
        """The saved settings with `changes` made (the others kept as they
        are). A damaged settings file is set aside first; where it cannot be,
        nothing is saved (OSError) rather than the file replaced."""
        with self.settings_lock:  # read, changed and written as one: two at once would lose one's change
            kept = self.set_aside_damaged_settings()
            if kept == SETTINGS_FILE:
                raise OSError(f"{self.folder / SETTINGS_FILE} cannot be read and cannot be set aside, so it is left as it is")
            self.set_aside = kept or self.set_aside  # damaged while the page was open: the next load says where it went
            try:  # a file that cannot be read just now (OSError) is left as it is: read as {}, the change would replace it
                saved = self._parse(self.folder / SETTINGS_FILE) or {}
            except FileNotFoundError:
                saved = {}
            self.save_settings({**saved, **changes})

    def chat_damage(self, chat_id: str) -> str:
        """What keeps the chat's file from being read as a chat, where it can be
        read (damaged by hand); "" where it holds the chat, is missing, or cannot
        be read just now (held by another program on Windows: not damage)."""
        path = self.chat_path(chat_id)
        try:
            value = self._parse(path)
        except OSError:
            return ""
        return "" if as_chat(value, chat_id) is not None else chat_file_problem(path)

    def chat_path(self, chat_id: str) -> Path:
        """The chat's file in the chats folder; ValueError for an id that would
        name another place: a path; on Windows a drive or stream (a colon), a device (CON, NUL...)."""
        if not chat_id or any(c in chat_id for c in "/\\\0") or chat_id.startswith(".") or (
            os.name == "nt" and (":" in chat_id or WINDOWS_DEVICE.fullmatch(chat_id))  # elsewhere file names like any other
        ):
            raise ValueError(f"invalid chat id {chat_id!r}")
        return self.folder / CHATS_FOLDER / f"{chat_id}.json"

    def save_chat(self, chat: dict, named: bool = False) -> None:
        """Write the chat (one without messages is not kept). Its name is its
        file's: another tab's view of the chat, or a reply begun before the
        chat was named, saves it with the name it has on disk; Rename
        (`named`) sets it, the chat's own name, or none, going to the file.
        A file there that cannot be read as a chat (damaged by hand) is left
        as it is: OSError naming it."""
        if not chat["messages"]:
            return
        path = self.chat_path(chat["id"])
        try:  # (its depth unchecked: read again at every save of a growing reply, read only for its name here)
            saved = self._parse(path, nesting=False)
        except OSError:  # none, or held a moment by another program (Windows): written as before
            saved = None
        else:
            if as_chat(saved, chat["id"]) is None:
                raise OSError(f"{path} can no longer be read ({chat_file_problem(path)}), so it is left as it is")
        if saved is not None and not named:
            chat.pop("name", None)
            if name := kept_name(saved.get("name")):
                chat["name"] = name
        chat["updated"] = time.time()
        chat["title"] = chat_title(chat)
        text = json.dumps(chat, indent=1, ensure_ascii=False)
        if LONE_SURROGATE.search(text):  # rare (a model's folder name that is not UTF-8): its texts are gone through only then
            text = json.dumps(well_formed(chat), indent=1, ensure_ascii=False)
        write_atomic(path, text)

    def load_chat(self, chat_id: str) -> dict | None:
        return as_chat(self.read_object(self.chat_path(chat_id)), chat_id)

    def delete_chat(self, chat_id: str) -> None:
        path = self.chat_path(chat_id)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            if path.exists() or path.is_symlink():  # a read-only folder refuses even a missing file's unlink
                raise

    def list_chats(self) -> list[dict]:
        """(id, title, updated) of every readable chat, newest first."""
        return self.scan_chats()[0]

    def scan_chats(self) -> tuple[list[dict], list[str]]:
        """list_chats, and the names of the chat files that cannot be read
        (left as they are on disk), or not opened by their names (chat_path's
        refusals). Names starting with a dot are not chats (write_atomic's
        temporary files among them)."""
        chats, unreadable = [], []
        for path in (self.folder / CHATS_FOLDER).glob("*.json"):
            if path.name.startswith("."):
                continue
            chat = as_chat(self.read_object(path), path.stem) if self.openable(path.stem) else None
            if chat is None:
                unreadable.append(path.name)
                continue
            chats.append({"id": chat["id"], "title": chat["title"] or chat_title(chat), "updated": chat["updated"]})
        return sorted(chats, key=lambda chat: chat["updated"], reverse=True), sorted(unreadable)

    def why_unreadable(self, name: str) -> str:
        """What is wrong with the chat file `name` (one scan_chats found unreadable), in a few words."""
        if not self.openable(name.removesuffix(".json")):
            return "not a name Kestrel can open"
        return chat_file_problem(self.folder / CHATS_FOLDER / name)

    def openable(self, chat_id: str) -> bool:
        """Whether chat_path takes `chat_id`: a file copied in from elsewhere may be
        named what it refuses (a backslash, on Windows a device name)."""
        try:
            self.chat_path(chat_id)
        except ValueError:
            return False
        return True

    def add_chat(self, chat: dict, in_use: Collection[str] = ()) -> dict:
        """A chat from elsewhere (an export) saved as a chat of its own: under its
        own id where that is one new_chat could have made and no saved chat (nor
        one `in_use`) has, else under a new one, so that no saved chat is replaced.
        -> the chat as saved (its id, title and time of saving set)."""
        chat_id = chat.get("id")
        if not (isinstance(chat_id, str) and CHAT_ID.fullmatch(chat_id)) or chat_id in in_use or self.chat_path(chat_id).exists():
            chat_id = new_chat()["id"]
        saved = {**chat, "id": chat_id}
        self.save_chat(saved, named=True)
        return saved

    @classmethod
    def read_object(cls, path: Path) -> dict | None:
        """The JSON object in `path`; None when missing, unreadable or damaged
        (such a file is skipped rather than breaking the app)."""
        try:
            return cls._parse(path)
        except OSError:
            return None

    @staticmethod
    def _parse(path: Path, nesting: bool = True) -> dict | None:
        """The JSON object in `path` (a UTF-8 byte order mark, as some editors
        write, allowed; lone surrogates read as U+FFFD: well_formed); None where
        it holds none, or (`nesting`) one nested deeper than NESTING_LIMIT; OSError where it cannot be read."""
        try:
            text = path.read_text(encoding="utf-8-sig")
            value = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: arrays or objects nested too deep for Python's reader
            return None
        if not isinstance(value, dict) or (nesting and nested_deeper(value, NESTING_LIMIT)):
            return None
        return well_formed(value) if SURROGATE_ESCAPE.search(text) else value  # rare: its texts are gone through only then


def nested_deeper(value, limit: int) -> bool:
    """Whether `value` holds lists or objects more than `limit` levels deep (itself the first), gone through level by level."""
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(limit):
        level = [item for held in level for item in (held.values() if isinstance(held, dict) else held) if isinstance(item, (list, dict))]
        if not level:
            return False
    return True


def chat_file_problem(path: Path) -> str:
    """What keeps the file at `path` from being a chat, in a few words ("not a chat" where nothing more is known)."""
    if path.is_dir():
        return "a folder, not a file"
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except OSError as error:
        return f"cannot be opened: {error.strerror or error}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return "empty" if not text.strip() else f"not valid JSON: {error.msg}: line {error.lineno} column {error.colno}"
    except (ValueError, RecursionError):
        return "not valid JSON: nested too deep"
    if not isinstance(value, dict):
        return "not a chat: a JSON object is expected"
    if nested_deeper(value, NESTING_LIMIT):
        return f"not a chat: it holds values nested more than {NESTING_LIMIT} levels deep"
    messages = value.get("messages")
    if not isinstance(messages, list):
        return "not a chat: its messages are not a list"
    for index, message in enumerate(messages):
        if problem := message_problem(message):
            return f"message {index + 1} {problem}"
    return "not a chat"


ROLES = ("user", "assistant")  # the roles the page writes (the system prompt is the chat's own field)


def message_problem(message) -> str | None:
    """What keeps a stored message from being one the page shows and sends, in a few words; None where it is one."""
    if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
        return "has no text"
    if message.get("role") not in ROLES:
        return f"has the role {str(message.get('role'))[:20]!r}, not user or assistant"
    return None


def as_chat(value: dict | None, chat_id: str) -> dict | None:
    """A stored chat with every field the app reads, or None when its messages
    are not a list of {role, content} strings with the roles the page writes
    (user and assistant: the system prompt is the chat's own field; a message
    of another role would reach the model unseen on the page). The file's name is its id;
    fields it lacks (a file edited by hand, or from an older version) get
    new_chat's defaults, and a missing time sorts it last."""
    if value is None:
        return None
    messages = value.get("messages")
    if not isinstance(messages, list) or any(message_problem(m) for m in messages):
        return None
    chat = {**new_chat(), "created": 0.0, "updated": 0.0, **value, "id": chat_id}
    chat["messages"] = [as_message(m) for m in messages]
    for key, kind, default in (("title", str, ""), ("system", str, ""), ("updated", (int, float), 0.0), ("created", (int, float), 0.0)):
        if not isinstance(chat[key], kind):
            chat[key] = default
    if kept_name(chat.get("name")) is None:
        chat.pop("name", None)
    for key in ("updated", "created"):
        if not 0 <= chat[key] <= LATEST_TIME:  # also NaN, which json reads
            chat[key] = 0.0
    session = chat["session"]
    counts = [session.get(k) for k in ("tokens", "forwards")] if isinstance(session, dict) else [None]
    if not all(isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= LARGEST_COUNT for count in counts):
        chat["session"] = {"tokens": 0, "forwards": 0}
    chat.pop("taken_back", None)  # the page's own, never saved (app/chat.py's TAKEN_BACK)
    return chat


def as_message(message: dict) -> dict:
    """A stored message; its coloured segments are dropped (the text shows
    uncoloured) unless they are [text, origin] pairs that make up its content.
    An origin other than "draft" and "base" (a later version's) shows as "base" and is
    kept, so that a save here does not drop what that version wrote."""
    segments = message.get("segments")
    if segments is None:
        return message
    valid = isinstance(segments, list) and all(
        isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and isinstance(s[1], str) for s in segments
    )
    if valid and "".join(s[0] for s in segments) == message["content"]:
        return message
    return {key: value for key, value in message.items() if key != "segments"}


# In a saved assistant message: the replies that regenerations replaced (Earlier reply shows them)
EARLIER = "earlier"


def earlier_replies(message: dict) -> list[dict]:
    """The message's earlier replies that can be shown (a hand-edited file may hold others)."""
    earlier = message.get(EARLIER)
    if not isinstance(earlier, list):
        return []
    return [as_message(m) for m in earlier if not message_problem(m) and m["role"] == "assistant"]


def quoted(text: str) -> str:
    """A message as a Markdown block quote: everything it opens (a code
    block, an HTML block, a list) ends with the quote, so nothing in it can
    reach into the next message or pass for one of the export's role labels."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(f"> {line}" if line else ">" for line in lines)


def to_markdown(chat: dict) -> str:
    lines = [f"# {inert_markdown(chat_title(chat))}", ""]
    if chat.get("system"):
        lines += ["**System:**", "", quoted(inert_markdown(chat["system"])), ""]
    for message in chat["messages"]:
        lines += [f"**{message['role'].capitalize()}:**", "", quoted(inert_markdown(message["content"])), ""]
        made = made_with(message.get("stats"))
        if made:  # its names are the file's as written (an imported chat's): on one line, and inert as a message is
            lines += [f"_{inert_markdown(' '.join(made.split()))}_", ""]
        if earlier := earlier_replies(message):
            lines += [f"_Earlier replies kept for this message: {len(earlier)} (the JSON export holds them)._", ""]
    return "\n".join(lines)


def oldest_messages(count: float) -> str:
    """'oldest message', or 'N oldest messages': the messages a reply was written without."""
    return "oldest message" if count == 1 else f"{count:g} oldest messages"


def made_with(stats) -> str:
    """A reply's stored figures and settings in one line, for the Markdown export."""
    if not isinstance(stats, dict):
        return ""
    settings = stats.get("settings") if isinstance(stats.get("settings"), dict) else {}
    parts = [str(stats["mode"])] if isinstance(stats.get("mode"), str) else []
    if isinstance(settings.get("model"), str):
        weights = ", ".join(settings[key] for key in ("dtype", "quantization") if isinstance(settings.get(key), str))
        parts.append(f"{settings['model']} ({weights})" if weights else settings["model"])
    if isinstance(settings.get("head"), str):
        parts.append(f"draft head {settings['head']}")
    if is_number(settings.get("temperature")) and settings["temperature"] > 0:
        parts.append(f"temperature {settings['temperature']:g}")
        parts += [f"{label} {settings[key]}" for key, label in (("top_p", "top-p"), ("top_k", "top-k"), ("seed", "seed"))
                  if is_number(settings.get(key))]  # fmt: skip
    elif "temperature" in settings:
        parts.append("greedy")
    if is_number(settings.get("max_new_tokens")):
        parts.append(f"at most {settings['max_new_tokens']} new tokens")
    tree = settings.get("tree") if isinstance(settings.get("tree"), dict) and stats.get("mode") == "eagle2" else {}  # EAGLE's is fixed
    if all(is_number(tree.get(key)) for key in ("total_tokens", "depth", "top_k")):
        shape = f"depth up to {tree['depth']}, top-k {tree['top_k']}"
        parts.append(f"trees sized by the planner ({shape})" if tree["total_tokens"] == 0 else f"trees of {tree['total_tokens']} tokens ({shape})")
    figures = (("tokens", "{} tokens"), ("tokens_per_s", "{:.1f} tokens/s"),
               ("decoding_tokens_per_s", "{:.1f} tokens/s after the first token"), ("tau", "tau {:.2f}"))  # fmt: skip
    parts += [form.format(stats[key]) for key, form in figures if is_number(stats.get(key))]
    endings = {"cancelled": "stopped before its end", "length": "cut at the token limit", "context": "cut at the context window",
               "interrupted": "cut short: Kestrel stopped while writing it"}  # fmt: skip
    if isinstance(stats.get("finish_reason"), str) and stats["finish_reason"] in endings:  # an edited file's list would not hash
        parts.append(endings[stats["finish_reason"]])
    dropped = settings.get("context_dropped")
    if is_number(dropped) and dropped > 0:
        parts.append(f"written without the {oldest_messages(dropped)} (past the context window)")
    return ", ".join(parts)


def to_json(chat: dict) -> str:
    return json.dumps(chat, indent=2, ensure_ascii=False)
