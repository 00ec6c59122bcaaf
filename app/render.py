"""Model text and statistics as HTML and plot data.

Model text is always HTML-escaped before it goes into any HTML: a reply that
contains `<script>` shows as text."""

from __future__ import annotations

import html
import itertools
import json
import math
import re
from collections.abc import Iterator, Sequence

import pandas as pd

from core.calibration import CurvePoint
from core.prompt import THINK_END, THINK_START
from core.stats import Snapshot

DRAFT, BASE = "draft", "base"  # token origins: drafted-and-accepted, or sampled by the base model
# Markdown code: fenced blocks (to the end while still streaming; ~~~ fences only
# where a line starts, as markdown reads them) and inline spans.
# A ``` fence opens only where a line starts (after indentation) and its info
# string holds no backtick, as markdown reads it; mid-line, backticks delimit
# inline code only when they close on the line. A fence ends with the first
# line that begins with its opening run (so ```` holds ```): markdown's
# readers end it there too where that line holds nothing else (surely_fenced).
CODE = re.compile(
    r"(?<![^\n])[ \t]*(?P<fence>`{3,})[^`\n]*(?![^\n]).*?(?:\n[ \t]*(?P=fence)[^\n]*|\Z)"
    r"|(?<![^\n]) {0,3}(?P<tildes>~{3,}).*?(?:\n {0,3}(?P=tildes)[^\n]*|\Z)"
    r"|(?<![\\`])(?P<ticks>`{1,3})(?!`)[^\n]+?(?<!`)(?P=ticks)(?!`)",
    re.DOTALL,
)
# Gradio 6.31's chatbot loads Prism's C++ grammar without the C one it extends, and
# the whole message then renders empty: C++ fences are highlighted as C instead.
# the C fence keeps the language it replaces ("```c cpp"), which COPY_JS restores.
CPP_FENCE = re.compile(r"^([ \t]*)```(cpp|c\+\+|cxx|cc)(?=\s)", re.IGNORECASE)
# A line's block syntax: indentation, block-quote markers, then a heading's
# hashes or a list marker (with a task box). Only these characters: safe raw.
BLOCK_PREFIX = re.compile(r"[ \t]{0,3}(?:>[ \t]?)*(?:(?:#{1,6}|[-*+]|\d{1,9}[.)])(?=[ \t]|$)[ \t]*(?:\[[ xX]\][ \t])?)?")
# Lines that are markdown syntax as a whole (rules, setext underlines, table
# delimiter rows) or indented code: never highlighted.
UNCOLOURED_LINE = re.compile(r"[ \t]*[-=*_|:+ \t]*\n?$|(?: {4}|\t)")
# Inline syntax that a highlight must neither cover nor split (backtick runs too,
# so that COPY_JS finds the same code spans in the coloured text).
INLINE_SYNTAX = re.compile(r"(?:https?|ftp)://\S*|(?<![\w.])www\.\S*|[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\\.|!?\[|\]\([^)\n]*\)|\]|\||[*_~`]+")
EMPHASIS_RUN = re.compile(r"[*_~]+")
DRAFT_STYLE = "background:rgba(46,160,67,0.28);border-radius:3px"
# Copying a chat message (its copy button, or the chat's): the text as written,
# not the markup above. Gradio copies a message's content: prose escaped by
# escape_prose with highlight spans, and code raw (CODE, matched here the same
# way; highlights and entities never make or break a code span). Highlighted
# runs never hold a "<" (escaped), so the spans come off exactly. A code block's
# own copy button (inside the message text) copies raw code and is left alone.
COPY_JS = """() => {
  const code = /(?<![^\\n])[ \\t]*(?<fence>`{3,})[^`\\n]*(?![^\\n])[\\s\\S]*?(?:\\n[ \\t]*\\k<fence>[^\\n]*|$)|(?<![^\\n]) {0,3}(?<tildes>~{3,})[\\s\\S]*?(?:\\n {0,3}\\k<tildes>[^\\n]*|$)|(?<![\\\\`])(?<ticks>`{1,3})(?!`)[^\\n]+?(?<!`)\\k<ticks>(?!`)/g;
  const fence = /^([ \\t]*)```c (cpp|c\\+\\+|cxx|cc)(?=\\s)/i;
  const decode = (text) => text.replace(/&#(\\d+);/g, (entity, number) => String.fromCodePoint(+number));
  // code that render.code_element and render.text_block made HTML: the text as written, decoded
  const escaped = /<code data-md="([^"]*)">[^<]*<\\/code>|<pre class="kestrel-text"><code>([^<]*)<\\/code><\\/pre>|&(amp|lt|gt|#96);/g;
  const named = {amp: "&", lt: "<", gt: ">", "#96": "`"};  // &#96;: a backtick that render._line wrote so
  const prose = (text) => text
    .replace(/<span class="kd" style="[^"]*">([^<]*)<\\/span>/g, "$1")
    .replace(escaped, (found, span, block, name) =>
      span !== undefined ? decode(span) : block !== undefined ? decode(block) : named[name]);
  const plain = (text) => {
    let out = "", last = 0;
    for (const match of text.matchAll(code)) {
      out += prose(text.slice(last, match.index)) + match[0].replace(fence, "$1```$2");
      last = match.index + match[0].length;
    }
    return out + prose(text.slice(last));
  };
  // a reasoning model's reasoning block (render.message_html): its tags back around it
  const think = /<details class="kestrel-think"(?: open| hidden)? data-open="([^"]*)" data-close="([^"]*)"(?: data-fence="(\\d+)")?><summary>[^<]*<\\/summary>\\n\\n([\\s\\S]*?)\\n\\n<\\/details>(?:\\n\\n|$)/g;
  const written = (text) => {
    let out = "", last = 0;
    for (const found of text.matchAll(think)) {
      const inner = found[3] ? found[4].slice(0, -Number(found[3])) : found[4];  // without the fence closed for the page
      out += plain(text.slice(last, found.index)) + decode(found[1]) + plain(inner) + decode(found[2]);
      last = found.index + found[0].length;
    }
    return out + plain(text.slice(last));
  };
  let fromChat = false;
  document.addEventListener("click", (event) => {
    const target = event.target.closest ? event.target : event.target.parentElement;
    fromChat = Boolean(target && target.closest("#chatbot") && !target.closest(".message-content"));
    setTimeout(() => { fromChat = false; }, 0);
  }, true);
  if (navigator.clipboard) {
    const write = navigator.clipboard.writeText.bind(navigator.clipboard);
    navigator.clipboard.writeText = (text) => write(fromChat ? written(text) : text);
  }
  // the notice lines are live regions: a screen reader says what they say (a refusal, "Stopped.", an error)
  // (the Compare and Models tabs are built when first opened: marked then)
  const live = ["notice", "bench-notice", "load-notice", "verdict-box"];
  const mark = () => {
    for (const id of live) {
      const element = document.getElementById(id);
      if (element && element.getAttribute("role") !== "status") {
        element.setAttribute("role", "status");
        element.setAttribute("aria-live", "polite");
      }
    }
  };
  // a message's accessible name: its text as shown, where Gradio names it by its markup
  // ("bot's message: This<span class=...>"), which a screen reader would spell out
  const accessible = (element) => {
    const label = element.getAttribute("aria-label");
    const at = label.indexOf("'s message: ");
    if (at < 0) return;
    const length = String(element.textContent.length);  // no layout: innerText only where the message changed
    if (label === element.dataset.kestrelLabel && length === element.dataset.kestrelLength) return;
    const text = label.slice(0, at + 12) + element.innerText.replace(/\\s+/g, " ").trim();  // lines apart, as shown
    element.dataset.kestrelLabel = text;
    element.dataset.kestrelLength = length;
    if (text !== label) element.setAttribute("aria-label", text);
  };
  const relabel = () => document.querySelectorAll(`#chatbot [aria-label*="'s message: "]`).forEach(accessible);
  mark();
  relabel();
  new MutationObserver(() => { mark(); relabel(); }).observe(document.body, { childList: true, subtree: true, attributes: true, attributeFilter: ["aria-label"] });
  document.addEventListener("copy", (event) => {  // without the clipboard API (http on a LAN): a selected textarea
    const active = document.activeElement;
    if (fromChat && active && active.tagName === "TEXTAREA") {
      event.clipboardData.setData("text/plain", plain(active.value));
      event.preventDefault();
    }
  }, true);
}"""
# Every event the page runs carries the version of the page it was served with
# (app/server.py's page_version); a server of another version refuses it, and
# the page then says so above everything with a Reload button (Gradio shows the
# refusal as the event's error too, which goes away by itself).
STALE_JS = """(version) => {
  const send = window.fetch.bind(window);
  const show = (text) => {
    let banner = document.getElementById("stale-page");
    if (!banner) {
      banner = document.createElement("div");
      banner.id = "stale-page";
      banner.setAttribute("role", "alert");
      banner.style.cssText = "position:fixed;top:0;left:0;right:0;z-index:2147483647;padding:10px 16px;display:flex;" +
        "flex-wrap:wrap;align-items:center;gap:12px;background:#fff3cd;color:#664d03;border-bottom:1px solid #e0c36a;font-size:15px";
      const words = document.createElement("span");
      const reload = document.createElement("button");
      reload.textContent = "Reload";
      reload.style.cssText = "padding:2px 12px;border:1px solid #664d03;border-radius:4px;background:#fff;color:#664d03";
      reload.addEventListener("click", () => window.location.reload());
      banner.append(words, reload);
      document.body.prepend(banner);
    }
    banner.firstChild.textContent = text;
  };
  window.fetch = async (input, init) => {
    const url = typeof input === "string" ? input : input instanceof URL ? input.href : input instanceof Request ? input.url : "";
    if (!url.includes("/queue/join")) return send(input, init);
    const headers = new Headers((init && init.headers) || (input instanceof Request ? input.headers : {}));
    headers.set("X-Kestrel-Page", version);
    const response = await send(input, { ...(init || {}), headers });
    if (response.status === 409 && response.headers.get("X-Kestrel-Stale")) {
      response.clone().json().then((body) => show(body.detail), () => show("Reload this page to go on."));
    }
    return response;
  };
}"""


# A slider's box brings a value typed past the slider's range back to the nearest end when
# it is left (the value replies then use, app/chat.py's SLIDERS): said under the slider, by
# name, until the slider holds a value in range again.
RANGE_JS = """() => {
  const check = (event) => {  // on the way down to the box, before the slider's own handlers bring it back
    const box = event.target;
    if (!(box instanceof HTMLInputElement) || box.dataset.testid !== "number-input" || !box.closest(".head")) return;
    const block = box.closest(".block");
    const value = Number(box.value), low = Number(box.min), high = Number(box.max);
    let note = block.querySelector(":scope .kestrel-range-note");
    if (box.value === "" || Number.isNaN(value) || (value >= low && value <= high)) {
      if (note && event.type === "change") note.remove();  // a value in range typed since
      return;
    }
    if (!note) {
      note = document.createElement("div");
      note.className = "kestrel-range-note";
      note.setAttribute("role", "status");
      note.style.cssText = "font-size:var(--text-sm);color:var(--body-text-color-subdued);margin-top:4px";
      block.append(note);
    }
    const label = box.closest(".head").querySelector("[data-testid='block-info']");
    const name = (label ? label.textContent : "This setting").replace(/\\s*\\(.*$/, "").trim();
    note.textContent = `${name}: ${box.value} is ${value > high ? "above the highest" : "below the lowest"} value, ` +
      `so it is set to ${value > high ? box.max : box.min}.`;
  };
  document.addEventListener("change", check, true);
  document.addEventListener("blur", check, true);
  document.addEventListener("input", (event) => {  // the slider moved: the note has had its say
    const block = event.target.type === "range" && event.target.closest(".block");
    const note = block && block.querySelector(":scope .kestrel-range-note");
    if (note) note.remove();
  }, true);
}"""


def page_js(version: str) -> str:
    """The page's load function: STALE_JS with this server's page version, then RANGE_JS and COPY_JS."""
    return f"() => {{ ({STALE_JS})({json.dumps(version)}); ({RANGE_JS})(); ({COPY_JS})(); }}"


# A message given back to the message box (app/ui.py's `returned`): the box as
# it is if nothing came back; else the message, followed by what was typed
# since it was sent (a next message), unless that is empty or the same.
GIVE_BACK_JS = """(returned, typed) => {
  if (!returned) return [typed, ""];
  const now = (typed || "").trim();
  return [!now || now === returned.trim() ? returned : returned + "\\n\\n" + typed, ""];
}"""
# Text typed into a box, kept in this tab's sessionStorage as it changes and put back when
# the page loads again (a reload, a restarted server): each tab keeps its own, and a box
# emptied by Send keeps nothing. Not text Edit put back (marked "-edited" until the box is
# emptied): the reloaded chat still holds that exchange, which Send would then repeat.
def keep_typed_js(key: str) -> str:
    return f"""(text) => {{ try {{
  sessionStorage.setItem("kestrel-{key}", text || "");
  if (!text) sessionStorage.removeItem("kestrel-{key}-edited");
}} catch (e) {{}} }}"""


# The id of the chat a tab shows, kept in its sessionStorage, so that a reload of
# that tab shows that chat again rather than the one another tab opened last.
KEEP_SHOWN_JS = """(shown) => { try { if (shown) sessionStorage.setItem("kestrel-shown-chat", shown); } catch (e) {} }"""
SHOWN_BACK_JS = """() => { try { return [sessionStorage.getItem("kestrel-shown-chat") || ""]; } catch (e) { return [""]; } }"""


def typed_back_js(key: str) -> str:
    """The text kept for the box; none where Edit put it there, and that text and
    its mark are let go (the box, empty already, fires no change that would drop
    the mark, which then kept the next text typed from coming back)."""
    return f"""() => {{ try {{
  if (!sessionStorage.getItem("kestrel-{key}-edited")) return sessionStorage.getItem("kestrel-{key}") || "";
  sessionStorage.removeItem("kestrel-{key}-edited");
  sessionStorage.removeItem("kestrel-{key}");
  return "";
}} catch (e) {{ return ""; }} }}"""


def edited_js(key: str) -> str:
    """After Edit: where it put a message back (its notice is empty), that text is not brought back by a reload."""
    return f"""(text, said) => {{ try {{ if (text && !said) sessionStorage.setItem("kestrel-{key}-edited", "1"); }} catch (e) {{}} }}"""


CSS = """
.kestrel-stats table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
.kestrel-stats td { padding: 2px 6px; border-bottom: 1px solid var(--border-color-primary); }
.kestrel-stats td.value { text-align: right; font-weight: 600; }
.kestrel-pane { white-space: pre-wrap; min-height: 12em; max-height: 30em; overflow-y: auto;
  padding: 8px; border: 1px solid var(--border-color-primary); border-radius: 6px; }
.kestrel-legend span { padding: 0 4px; }
/* the chat's clear and copy-all buttons in a row of their own above the messages, not over them */
#chatbot .icon-button-wrapper.top-panel { position: static; align-self: flex-end; margin: 2px 4px 0 0; }
#chatbot .bubble-wrap { height: auto; flex: 1 1 0; min-height: 0; }
/* a reasoning model's reasoning: folded under its summary once the answer begins, dimmed when open */
.kestrel-think { margin-bottom: 0.5em; opacity: 0.75; }
.kestrel-think > summary { cursor: pointer; font-style: italic; }
"""


def is_number(value) -> bool:
    """A finite int or float (not a bool): what a stored figure or setting must be to be used."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (JSON's integers have no limit)
        return False


def sentence(text: str) -> str:
    """An engine's message as the page's notices read: opening words of small
    letters capitalized ("no model is loaded" -> "No model is loaded"; never
    a name such as "config.json: ..." or a prompt's id before its colon), and
    a full stop where it ends on a letter or digit."""
    if re.match(r"[a-z]+ [a-z]+ ", text):
        text = text[0].upper() + text[1:]
    return f"{text}." if text[-1:].isalnum() else text


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def escape_prose(text: str) -> str:
    """Markdown prose that shows `text` as written: & < > as named entities
    (quotes need none once no tag can open), which COPY_JS turns back. Named,
    not numeric: the chatbot's link finder leaves a trailing named entity out
    of a bare URL, so <https://example.com> links to the address and shows its
    ">", where "&#62;" became part of the link and showed as typed."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def add_segment(segments: list[list[str]], text: str, origin: str) -> None:
    """Append `text` to [text, origin] segments, merging runs of one origin."""
    if not text:
        return
    if segments and segments[-1][1] == origin:
        segments[-1][0] += text
    else:
        segments.append([text, origin])


def split_step(text: str, accepted_text: str) -> list[tuple[str, str]]:
    """A step's text split by origin: its first `accepted` tokens decode to
    `accepted_text` (drafted), the rest came from the base model. When the
    detokenizer held back a split character the prefix may not match: the
    whole step then counts as drafted."""
    if not accepted_text:
        return [(text, BASE)]
    if text.startswith(accepted_text):
        return [(accepted_text, DRAFT), (text[len(accepted_text) :], BASE)]
    return [(text, DRAFT)]


def coloured(segments: list[list[str]], escaper=escape) -> str:
    """Escaped text with drafted-and-accepted runs highlighted."""
    parts = []
    for text, origin in segments:
        escaped = escaper(text)
        parts.append(f'<span class="kd" style="{DRAFT_STYLE}">{escaped}</span>' if origin == DRAFT else escaped)
    return "".join(parts)


def reasoning_spans(text: str) -> tuple[int, int, int, int] | None:
    """Where a reasoning model's reply holds its reasoning: (its start, its end,
    the answer's start, whether it is finished: 1 or 0), the tags and the
    newlines around them between; None for a reply without. Qwen3's begin
    with <think>; DeepSeek-R1's template opens it in the prompt, so theirs hold
    only </think> (one still thinking cannot be told from an answer)."""
    start, end = text.find(THINK_START), text.find(THINK_END)
    if 0 <= end and not 0 <= start < end:  # opened by the template
        inner = 0
    elif 0 <= start and not text[:start].strip():
        inner = start + len(THINK_START)
        inner += len(text[inner:]) - len(text[inner:].lstrip("\n"))
        if end < 0:  # still thinking, or cut there
            return inner, len(text), len(text), 0
    else:
        return None
    after = end + len(THINK_END)
    return inner, end, after + len(text[after:]) - len(text[after:].lstrip("\n")), 1


def cut_segments(segments: list[list[str]], start: int, end: int) -> list[list[str]]:
    """The [text, origin] segments of text[start:end]."""
    cut, position = [], 0
    for text, origin in segments:
        piece = text[max(start - position, 0) : max(end - position, 0)]
        add_segment(cut, piece, origin)
        position += len(text)
    return cut


def attribute_text(text: str) -> str:
    """`text` as an HTML attribute's value, every character a numeric entity (COPY_JS decodes them)."""
    return "".join(f"&#{ord(character)};" for character in text)


def message_html(message: dict, colour: bool) -> str:
    """What the chatbot shows for one stored message (see body_html); a
    reasoning model's reply (marked "reasoning", chat.reasoning_mark) has its
    reasoning in a block of its own, folded once the answer begins (hidden
    where it is empty, as Qwen3's is with thinking off), the tags around it
    kept in the block's attributes for COPY_JS to put back."""
    segments = message.get("segments") or [[message["content"], BASE]]
    text = "".join(piece for piece, _ in segments)
    spans = reasoning_spans(text) if message.get("reasoning") is True else None
    if spans is None:
        return body_html(segments, colour)
    inner, end, answer, finished = spans
    reasoning = body_html(cut_segments(segments, inner, end), colour)
    # a code block the reasoning leaves open (cut there, or still written) would hold the block's end and the answer
    fence = open_fence(text[inner:end])
    closing = f'\n{fence}' if fence else ""
    marked = f' data-fence="{len(closing)}"' if fence else ""  # what COPY_JS leaves out
    opened, closed = attribute_text(text[:inner]), attribute_text(text[end:answer])
    if not finished:  # open, with no answer to fold it under; a saved reply (its stats stored) is written no more
        state, title = " open", ("Reasoning (unfinished)" if isinstance(message.get("stats"), dict) else "Reasoning...")
    else:  # an empty one (Qwen3's with thinking off) is not shown
        state, title = ("" if text[inner:end].strip() else " hidden"), "Reasoning"
    return (f'<details class="kestrel-think"{state} data-open="{opened}" data-close="{closed}"{marked}>'
            f"<summary>{title}</summary>\n\n{reasoning}{closing}\n\n</details>\n\n"
            f"{body_html(cut_segments(segments, answer, len(text)), colour)}")  # fmt: skip


def open_fence(text: str) -> str:
    """The line that closes the code block body_html(text) leaves open (a fence
    it keeps raw that runs to the end unclosed), "" where it leaves none: the
    fence's run, indented as its opening line (a list item's fence closes only
    inside the item)."""
    kept = list(page_code(text))
    if not kept:
        return ""
    match, raw = kept[-1]
    if not raw or match["ticks"] or match.end() < len(text) or _closing(match.group()) is not None:
        return ""
    return FENCE_RUN.match(match.group()).group()


def body_html(segments: list[list[str]], colour: bool) -> str:
    """Markdown whose prose is
    HTML-escaped (drafted runs highlighted when `colour`). Code spans and fences
    stay raw: the markdown renderer already shows their content as text, and
    escaping there would show the entities themselves. Raw text holding a "<"
    is kept only where it cannot open a tag (page_code), else it could: an
    inline span holding one becomes an HTML <code> element, a fence that the
    renderer may read otherwise an HTML <pre> block, both with their text
    escaped (and the text as written beside it, for COPY_JS)."""
    text = "".join(piece for piece, _ in segments)
    origins = [origin if colour else BASE for piece, origin in segments for _ in piece]
    parts, position = [], 0
    for match, raw in page_code(text):
        code = match.group()
        if match["ticks"]:
            shown = code if raw else code_element(code, len(match["ticks"]))
        else:  # every fence is checked: one that markdown closed elsewhere would shift the ones after it
            shown = CPP_FENCE.sub(r"\1```c \2", code) if raw else text_block(code)
        parts += [_prose(text, origins, position, match.start()), shown]
        position = match.end()
    parts.append(_prose(text, origins, position, len(text)))
    return "".join(parts)


def page_code(text: str) -> Iterator[tuple[re.Match, bool]]:
    """CODE's matches in `text`, each with whether body_html keeps it raw: a
    fence that markdown surely reads as one (readings), as raw_fence allows;
    an inline span holding no "<", or one that markdown may pair otherwise
    and whose "<" can open no tag (an HTML <code> element could then land
    inside another span, which shows its markup: raw, it reads as markdown
    reads it)."""
    hidden = hidden_from(text, math=True)
    for match, sure in readings(text):
        code = match.group()
        if match["ticks"]:
            yield match, "<" not in code or not (sure or TAG_START.search(code))
        else:
            yield match, sure and raw_fence(code, match.end() > hidden)


def readings(text: str) -> Iterator[tuple[re.Match, bool]]:
    """CODE's matches in `text`, each with whether markdown surely reads it as
    found here. A fence: as surely_fenced says, but none after a fence opened
    behind a list or quote marker ("- ```"), which CODE does not see: from
    there on it cannot tell which fence lines open and which close. An inline
    span: where nothing before it in its paragraph (since a blank line or a
    sure fence) can have paired backticks otherwise (a backtick CODE left
    alone, as markdown pairs them across lines; a span or fence not sure), it
    holds no carriage return (a line break to markdown, where a block can
    begin) nor "|" (a GFM table's cell border), and no "~" is right before it
    (marked, Gradio's reader, takes a backtick after tildes as text)."""
    marked = MARKED_FENCE.search(text)
    unsure_from = marked.start() if marked else len(text) + 1
    clean, position = True, 0
    for match in CODE.finditer(text):
        paragraphs = BLANK_LINE.split(text[position : match.start()])
        clean = (clean or len(paragraphs) > 1) and "`" not in paragraphs[-1]
        code = match.group()
        if match["ticks"]:
            sure = clean and not ("\r" in code or "|" in code or text[match.start() - 1 : match.start()] == "~")
        else:
            sure = match.start() < unsure_from and surely_fenced(text, match.start(), match.end())
        yield match, sure
        clean, position = sure, match.end()


def hidden_from(text: str, math: bool) -> int:
    """Where Gradio's chatbot or a markdown reader may first read a fence line
    as something else ($$ math, which Gradio takes out first, where `math`; a
    link definition's target or title; a lone carriage return, a line break),
    len(text) where nowhere: the lines before it read as CODE reads them,
    and a fence reaching past it and holding a "<" is never raw."""
    definition = LINK_DEFINITION.search(text)
    found = [text.find("\r"), text.find("$$") if math else -1, definition.start() if definition else -1]
    return min((at for at in found if at >= 0), default=len(text))


# a "<" that opens an HTML tag, comment, declaration or processing instruction; not one opening
# an autolink as CommonMark defines them (<https://...>, <name@example.org>), where it starts with a
# letter or digit (HTML's "<!--" and "<?" win over an address, as readers parse them)
TAG_START = re.compile(
    r"<(?=[A-Za-z/!?])(?![A-Za-z][A-Za-z0-9+.-]{1,31}:[^\s<>]*>"
    r"|[A-Za-z0-9][A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]*@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*>)"
)
COMMENT_START = re.compile(r"<(?=[!?])")


def inert_markdown(text: str) -> str:
    """Markdown as written, but a "<" that would open an HTML tag or comment
    in prose written as &lt;, so that a viewer rendering the Markdown export
    shows such text as the page does (as text) rather than running it (a
    <style> rule there can hide the whole document). Code stays as written
    where markdown surely reads it as code (readings: a fence it opens and
    closes as found here, before anything that may hide its lines, and an
    inline span it pairs so, holding no comment); elsewhere its tags are made
    text too."""
    hidden = hidden_from(text, math=False)
    parts, position = [], 0
    for match, sure in readings(text):
        code = match.group()
        if match["ticks"]:  # markdown shows a span as text; a comment in one could be prose's
            shown = (COMMENT_START if sure else TAG_START).sub("&lt;", code)
        else:
            if not sure:  # markdown may pair the fences after it otherwise too
                hidden = min(hidden, match.start())
            raw = sure and ("<" not in code or (match.end() <= hidden and "<" not in code.partition("\n")[0]))
            shown = code if raw else TAG_START.sub("&lt;", code)
        parts += [TAG_START.sub("&lt;", text[position : match.start()]), shown]
        position = match.end()
    parts.append(TAG_START.sub("&lt;", text[position:]))
    return "".join(parts)


def raw_fence(code: str, hidden: bool) -> bool:
    """Whether a fence that markdown surely reads as one may stay raw: not a
    mermaid one (Gradio's chatbot puts its text into the page unescaped), and
    one holding a "<" only where nothing can hide its lines from markdown and
    its opening line holds none (an opening line that ends the message, as
    Gradio trims it, is read as text)."""
    if MERMAID.search(code):  # its own line, or one inside a tilde fence: Gradio finds it there too
        return False
    return "<" not in code or (not hidden and "<" not in code.partition("\n")[0])


def entities(text: str, keep: str = " ") -> str:
    """Every character but letters, digits and those in `keep` as a numeric
    entity: neither HTML nor markdown reads anything in the result."""
    return "".join(c if c.isalnum() or c in keep else f"&#{ord(c)};" for c in text)


def code_element(span: str, ticks: int) -> str:
    """An inline code span as an HTML <code> element, escaped; `data-md`
    holds the span as written, which COPY_JS copies."""
    inner = span[ticks:-ticks]
    if len(inner) > 2 and inner.startswith(" ") and inner.endswith(" ") and inner.strip():
        inner = inner[1:-1]  # markdown drops one space on each side
    return f'<code data-md="{entities(span)}">{entities(inner)}</code>'


def text_block(code: str) -> str:
    """A fence that markdown may not read as one, as an HTML <pre> block of
    its text as written, fence lines included, escaped: markdown reads no
    code, tag or syntax in it, and reads what follows from the next line on,
    as it would after a fence."""
    return '<pre class="kestrel-text"><code>' + entities(code, " \n") + "</code></pre>"


LIST_ITEM = re.compile(r"( *)([-*+]|\d{1,9}[.)])( +|$)")
FENCE_RUN = re.compile(r"[ \t]*(`{3,}|~{3,})")
MERMAID = re.compile(r"(?:`{3,}|~{3,})[ \t]*mermaid", re.IGNORECASE)
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]*\]:", re.MULTILINE)
MARKED_FENCE = re.compile(r"^[ \t]*(?:(?:[-*+]|\d{1,9}[.)])[ \t]+|>[ \t]?)+(?:`{3,}|~{3,})", re.MULTILINE)
BLANK_LINE = re.compile(r"\n[ \t]*\n")
TICK_OPENING = re.compile(r"([ \t]*(?:(?:[-*+]|\d{1,9}[.)])[ \t]+|>[ \t]?)*)(`{3,})")


def _indent(line: str) -> int:
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip(" "))


def _closing(code: str) -> str | None:
    """The line that ends a fence CODE matched (its last), None where it runs unclosed to the end."""
    run = FENCE_RUN.match(code).group(1)
    last = code.rpartition("\n")[2]
    return last if "\n" in code and last.lstrip(" \t").startswith(run) else None


def surely_fenced(text: str, start: int, end: int) -> bool:
    """Whether markdown surely reads `code` (a fence matched by CODE at
    `start`) as one code block: its opening line indented 4 or more only as
    a list item's fence; no line in it is indented less than that line, so
    none can end a list item it belongs to (and the code block with it); and
    its closing line, if any, closes it for markdown too: indented as that
    line, with spaces, and holding only the fence's character and spaces
    after (CODE ends a fence at any line beginning with its run, however
    indented; CommonMark's readers and marked, the page's, agree on these)."""
    lines = text[start:end].split("\n")
    indent = _indent(lines[0])
    if any(line.strip() and _indent(line) < indent for line in lines[1:]):
        return False
    character = FENCE_RUN.match(lines[0]).group(1)[0]
    closing = _closing(text[start:end])
    if closing is not None and (_indent(closing) != indent or not re.fullmatch(f" *{character}+ *", closing)):
        return False
    if indent <= 3:
        return True
    between = indent  # the least indentation of the lines between the list item and the fence
    for line in reversed(text[:start].split("\n")[:-1]):  # the lines above, nearest first
        if not line.strip():
            continue
        item = LIST_ITEM.match(line.expandtabs(4))
        if item is not None:
            spaces = len(item.group(3))
            offset = len(item.group(1)) + len(item.group(2)) + (spaces if 1 <= spaces <= 4 else 1)
            return offset <= indent <= offset + 3 and between >= offset
        between = min(between, _indent(line))
        if between < indent - 3:  # below any list item's content the fence could be in
            return False
    return False


def _prose(text: str, origins: list[str], start: int, end: int) -> str:
    """Escaped prose, line by line: highlights stay inside a line's inline
    text, so that colouring never changes how the markdown renders."""
    parts, position = [], start
    while position < end:
        newline = text.find("\n", position, end)
        stop = end if newline < 0 else newline + 1
        piece = text[position:stop]
        spanned = stop < len(text) and not piece.endswith("\n")  # an inline span follows on its line
        parts.append(_line(piece, origins[position:stop], spanned))
        position = stop
    return "".join(parts)


def _line(line: str, origins: list[str], spanned: bool = False) -> str:
    """One line of prose. Its block syntax (indentation, quote and list
    markers, heading hashes) stays raw so that markdown sees it; rules, table
    delimiter rows and indented lines are not highlighted; within the rest,
    highlights never cover a newline, a table pipe, an escape, link brackets
    or emphasis markers, whose meaning depends on their neighbours, nor a bare
    address (http://, https://, ftp://, www., an e-mail address), which a
    highlight would cut out of its link. A backtick run beginning a line that
    an inline span goes on to (`spanned`) is no fence (its info string holds a
    backtick), but would open one if the span became an HTML <code> element:
    its backticks are written as entities, which COPY_JS turns back."""
    opening = TICK_OPENING.match(line) if spanned else None
    if opening is not None:
        markers, run = opening.groups()
        return markers + "&#96;" * len(run) + _line(line[opening.end() :], origins[opening.end() :])
    if UNCOLOURED_LINE.match(line):
        return escape_prose(line)
    prefix = BLOCK_PREFIX.match(line).end()
    marks = [origin == DRAFT and char != "\n" for char, origin in zip(line, origins)]
    for syntax in INLINE_SYNTAX.finditer(line, prefix):
        marks[syntax.start() : syntax.end()] = [False] * (syntax.end() - syntax.start())
    # a highlight beside an emphasis run inside a word ("这是**重要**的", "foo**bar**baz") would stand for
    # punctuation there (its tag), and the run would then open or close nothing: the drafted text beside it stays plain
    for run in EMPHASIS_RUN.finditer(line, prefix):
        if line[run.start() - 1 : run.start()].isalnum() and line[run.end() : run.end() + 1].isalnum():
            _unmark(marks, run.start() - 1, -1)
            _unmark(marks, run.end(), 1)
    runs = []
    for mark, indices in itertools.groupby(range(prefix, len(line)), key=marks.__getitem__):
        indices = list(indices)
        runs.append([line[indices[0] : indices[-1] + 1], DRAFT if mark else BASE])
    return line[:prefix] + coloured(runs, escape_prose)


def _unmark(marks: list[bool], index: int, step: int) -> None:
    """Clear the run of marks from `index` on, going by `step`."""
    while 0 <= index < len(marks) and marks[index]:
        marks[index] = False
        index += step


def pane_html(segments: list[list[str]], elem_class: str = "kestrel-pane") -> str:
    return f'<div class="{elem_class}">{coloured(segments)}</div>'


LEGEND = (
    f'<div class="kestrel-legend"><span style="{DRAFT_STYLE}">drafted by the head, accepted</span>'
    "<span>sampled by the base model</span></div>"
)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def stats_html(
    snapshot: Snapshot | None, tree_size: int, session_tau: float | None, note: str = "", saved: dict | None = None
) -> str:
    """The side panel: each value has an id so that tests and eyes can find it.
    Without a live reply, `saved` is the last reply's stored summary (a chat opened or reloaded)."""
    if snapshot is None:
        session = "-" if session_tau is None else f"{session_tau:.2f}"
        saved = saved or {}

        def figure(key: str, form: str) -> str:
            return form.format(saved[key]) if is_number(saved.get(key)) else "-"

        rows = [
            ("tokens/s", figure("tokens_per_s", "{:.1f}"), "tps"),
            ("tokens/s after the first token", figure("decoding_tokens_per_s", "{:.1f}"), "tps-decoding"),
            ("tau (this reply)", figure("tau", "{:.2f}"), "tau"),
            ("tau (this chat, drafted replies)", session, "tau-session"),
        ]
        if saved:
            rows += [
                ("tokens", figure("tokens", "{:.0f}"), "tokens"),
                ("base-model forwards", figure("forwards", "{:.0f}"), "forwards"),
                ("time to first token", figure("time_to_first_token", "{:.2f} s"), "ttft"),
                ("prompt tokens not read again (kept)", figure("reused_tokens", "{:.0f}"), "reused"),
                ("mean tree: nodes / depth", figure("mean_tree_size", "{:.1f}") + " / " + figure("mean_tree_depth", "{:.1f}"), "tree-mean"),
            ]
            settings = saved.get("settings") if isinstance(saved.get("settings"), dict) else {}
            if is_number(settings.get("context_dropped")) and settings["context_dropped"] > 0:  # what the reply was written without
                rows.append(("oldest messages left out (context window)", f"{settings['context_dropped']:g}", "dropped"))
    else:
        busy = snapshot.draft_seconds + snapshot.verify_seconds
        share = f"{100 * snapshot.draft_seconds / busy:.0f}% / {100 * snapshot.verify_seconds / busy:.0f}%" if busy else "-"
        if snapshot.mean_tree_size <= 1:  # vanilla, or no step drafted: its "draft" is only the root's one-node tree
            share = "- (nothing drafted)"
        rows = [
            ("tokens/s", f"{snapshot.tokens_per_s:.1f}", "tps"),
            ("tokens/s after the first token", _rate(snapshot.decoding_tokens_per_s), "tps-decoding"),
            ("tau (this reply)", f"{snapshot.mean_accepted_length:.2f}", "tau"),
            ("tau (this chat, drafted replies)", "-" if session_tau is None else f"{session_tau:.2f}", "tau-session"),
            ("tokens", str(snapshot.tokens), "tokens"),
            ("base-model forwards", str(snapshot.forwards), "forwards"),
            ("time to first token", _seconds(snapshot.time_to_first_token), "ttft"),
            ("prompt tokens not read again (kept)", str(snapshot.reused_tokens), "reused"),
            ("draft / verify time", share, "share"),
            ("tree size (last step)", str(tree_size), "tree"),
            ("mean tree: nodes / depth", f"{snapshot.mean_tree_size:.1f} / {snapshot.mean_tree_depth:.1f}", "tree-mean"),
        ]
    cells = "".join(
        f'<tr><td>{label}</td><td class="value" id="stat-{key}">{escape(value)}</td></tr>' for label, value, key in rows
    )
    footer = f"<p>{escape(note)}</p>" if note else ""
    return f'<div class="kestrel-stats"><table>{cells}</table>{footer}</div>'


# the depth chart's order: its labels sorted as text put 10-16 between 1 and 2 (the context branch drafts deeper than 9)
DEPTH_ORDER = [str(depth) for depth in range(1, 129)]


def depth_frame(snapshot: Snapshot | None, saved: Sequence[float] = ()) -> pd.DataFrame:
    """Acceptance rate per draft depth, for the bar chart: the live reply's, or
    the `saved` rates of a stored one."""
    rates = snapshot.acceptance_by_depth if snapshot is not None else saved
    # depths are labels, even in the empty frame: the page's chart fixes its axis type at its first
    # value, and an empty column of floats made it a number axis (ticks at 0.5, 1.5, ...)
    depths = pd.Series([str(d + 1) for d in range(len(rates))], dtype=object)
    return pd.DataFrame({"depth": depths, "acceptance": pd.Series(list(rates), dtype=float)})


def calibration_frame(points: list[CurvePoint]) -> pd.DataFrame:
    """Measured acceptance of drafted nodes against their draft confidence,
    with the diagonal (a perfectly calibrated head) for reference."""
    # Before any measurement the series is one row without values (drawn as nothing): the page's
    # plot fixes its colour scale to the series of its first value, and a series it did not
    # know then would be drawn without a colour, invisibly.
    measured = [("measured", p.confidence, p.accepted) for p in points] or [("measured", math.nan, math.nan)]
    rows = [("diagonal", 0.0, 0.0), ("diagonal", 1.0, 1.0), *measured]
    return pd.DataFrame(rows, columns=["series", "draft confidence", "accepted"])


def rate_frame(points: list[tuple[float, float]]) -> pd.DataFrame:
    """(seconds since the request started, tokens/s over the last interval)."""
    return pd.DataFrame({"seconds": [p[0] for p in points], "tokens/s": [p[1] for p in points]})
