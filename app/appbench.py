"""`launch.py bench-app`: the tokens/s a user sees, one prompt at a time,
through each way of using Kestrel: the `chat` command, the /v1 API (the
official openai client), the page's endpoint (gradio_client, no browser) and
the page in headless Chromium. The server runs as its own process, as when a
user starts it; every run is greedy with the same prompt and settings, one
after the other, and reads the prompt afresh (the server keeps no caches
between requests here), and the chat command and the server each answer a
built-in prompt untimed first, so the ratios to the `chat` command are comparable."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from models.errors import KestrelError


CHROMIUM = Path("/usr/bin/chromium")
CHAT_RATE = re.compile(r"\[\w+\] (\d+) tokens in [\d.]+ s: ([\d.]+) tokens/s")
SERVER_URL = re.compile(r"running at (http://127\.0\.0\.1:\d+/?)")
PAGE_RATE = re.compile(r'id="stat-tps">([\d.]+)<')


def run_app_bench(
    prompt: str, modes: list[str], max_new_tokens: int, threads: int, port: int, root: Path, rounds: int, show,
    partial: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """One row per (way, mode, round): tokens, the tokens/s that way reports
    and its ratio to the chat command of the same round. Each round runs every
    way right after the chat command, so that the machine's drift over minutes
    touches the ratio little; the server idles while the chat command runs.
    The server's data folder (its chats and log) is removed after a run that
    finished, and kept, with its log, after one that failed. `partial`: called
    with the rows so far after each one, so that a run cut short keeps them."""
    environment = {**os.environ, "KESTREL_DATA_DIR": tempfile.mkdtemp(prefix="kestrel-bench-app-")}
    log = Path(environment["KESTREL_DATA_DIR"]) / "server.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [sys.executable, str(root / "launch.py"), "ui", "--no-browser", *fresh_reads(root), "--port", str(port), "--threads", str(threads)],
            stdout=output, stderr=subprocess.STDOUT, env=environment,
        )  # fmt: skip
    rows = []
    try:
        show(f"starting the server on port {port} (it loads and compiles the model first)")
        url = wait_until_up(log, server)
        model = api_model(url)
        show("warming the server up: one untimed reply per mode (the chat command answers one first too)")
        warm_server(url, model, modes)
        for round_index in range(rounds):
            for mode in modes:
                def measure(way: str, result: dict, chat: dict | None = None) -> dict:
                    """The row of `result`, its ratio to the `chat` command's row (None: it is that row)."""
                    row = {"way": way, "mode": mode, "round": round_index + 1, **result}
                    row["vs_chat_command"] = round(row["tokens_per_s"] / (chat or row)["tokens_per_s"], 3)
                    rows.append(row)
                    if partial is not None:
                        partial(rows)
                    return row

                show(f"round {round_index + 1}: chat command, {mode}")
                cli = measure("chat command", chat_command(root, prompt, mode, max_new_tokens, threads, environment))
                if model is not None:
                    show(f"round {round_index + 1}: API, {mode}")
                    measure("API (openai client)", through_api(url, model, prompt, mode, max_new_tokens), cli)
                show(f"round {round_index + 1}: gradio_client, {mode}")
                measure("page endpoint (gradio_client)", through_gradio_client(url, prompt, mode, max_new_tokens), cli)
                if CHROMIUM.exists():
                    show(f"round {round_index + 1}: Chromium, {mode}")
                    measure("page in Chromium", through_browser(url, prompt, mode, max_new_tokens, cli["tokens"]), cli)
    except BaseException:  # an error, Ctrl-C or SIGTERM: the server's log is what tells why
        show(f"the server's log and data are kept in {environment['KESTREL_DATA_DIR']}")
        raise
    finally:
        server.terminate()
        server.wait(30)
    shutil.rmtree(environment["KESTREL_DATA_DIR"], ignore_errors=True)
    return rows


def fresh_reads(root: Path) -> list[str]:
    """The server's option to read every prompt afresh, as the chat command does
    (one that continued the previous way's caches for the same prompt would skip
    reading it), where the Kestrel at `root` has it (an older one, measured for
    comparison, has not)."""
    return ["--no-kept-caches"] if offers(root, "--no-kept-caches") else []


def offers(root: Path, text: str) -> bool:
    """Whether the commands of the Kestrel at `root` (its app/cli.py) hold `text`: an option an older one lacks."""
    try:
        return text in (root / "app" / "cli.py").read_text(encoding="utf-8")
    except OSError:
        return False


def warm_chat(root: Path) -> list[str]:
    """The chat command's option to answer a built-in prompt untimed first, so
    that its timed reply is not a new process's first one (the server, whose
    rows it is set beside, is warm), where the Kestrel at `root` has it."""
    return ["--warmup", "1"] if offers(root, 'chat.add_argument("--warmup"') else []


def warm_server(url: str, model: str | None, modes: list[str]) -> None:
    """One untimed request per mode through the server before the first round, at
    16 tokens, with a built-in prompt: its first timed request is not its first."""
    from core.bench import WARMUP_PROMPTS, WARMUP_TOKENS

    for mode in modes:
        if model is not None:
            through_api(url, model, WARMUP_PROMPTS[0], mode, WARMUP_TOKENS)
        else:  # an older Kestrel without the API
            through_gradio_client(url, WARMUP_PROMPTS[0], mode, WARMUP_TOKENS)


def chat_command(root: Path, prompt: str, mode: str, max_new_tokens: int, threads: int, environment: dict) -> dict:
    # the prompt after "--", where no text of it ("-v", "--help") is read as an option; "-" alone is
    # standard input to the chat command, so it is given there
    command = [sys.executable, str(root / "launch.py"), "chat", "--mode", mode, *warm_chat(root),
               "--max-new-tokens", str(max_new_tokens), "--threads", str(threads), "--", prompt]  # fmt: skip
    done = subprocess.run(command, input=prompt if prompt == "-" else "", capture_output=True, text=True, env=environment)
    if done.returncode != 0:  # its own error line says why
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise KestrelError(f"the chat command ({mode}) failed: {last}")
    tokens, rate = CHAT_RATE.findall(done.stdout + done.stderr)[-1]  # the figures' line: on stderr, on stdout in older versions
    return {"tokens": int(tokens), "tokens_per_s": float(rate)}


def wait_until_up(log: Path, server: subprocess.Popen, timeout: float = 600) -> str:
    """The server's address once it answers there (it may have moved to the
    next free port, as its first printed line says)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise KestrelError(f"the server exited with code {server.returncode}; see {log}")
        found = SERVER_URL.search(log.read_text(errors="replace"))
        if found:
            try:
                url = found.group(1).rstrip("/") + "/"
                if httpx.get(url, timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise KestrelError(f"the server did not start within {timeout:.0f} s; see {log}")


def api_model(url: str) -> str | None:
    """The model id the server's /v1 API serves, or None without an API."""
    models = httpx.get(f"{url}v1/models")
    return models.json()["data"][0]["id"] if models.status_code == 200 else None


def through_api(url: str, model: str, prompt: str, mode: str, max_new_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{url}v1", api_key="unused", max_retries=0, timeout=600)
    started, usage = time.perf_counter(), None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_new_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body={"kestrel": {"mode": mode}},
    )  # fmt: skip
    for chunk in stream:
        usage = chunk.usage or usage
    seconds = time.perf_counter() - started
    speculative = usage.model_dump()["speculative"]
    return {"tokens": usage.completion_tokens, "tokens_per_s": speculative["tokens_per_second"],
            "client_tokens_per_s": round(usage.completion_tokens / seconds, 2)}  # fmt: skip


def page_values(mode: str, max_new_tokens: int) -> list:
    from app.chat import SETTINGS, default_settings

    settings = {**default_settings(), "mode": mode, "temperature": 0, "max_new_tokens": max_new_tokens}
    return [settings[name] for name in SETTINGS]


def through_gradio_client(url: str, prompt: str, mode: str, max_new_tokens: int) -> dict:
    from gradio_client import Client

    client = Client(url, verbose=False)
    job = client.submit(prompt, "", *page_values(mode, max_new_tokens), api_name="/send")
    updates = sum(1 for _ in job)
    stats = next(value for value in job.result() if isinstance(value, str) and "stat-tps" in value)
    tokens = re.search(r'id="stat-tokens">(\d+)<', stats)
    return {"tokens": int(tokens.group(1)), "tokens_per_s": float(PAGE_RATE.search(stats).group(1)), "updates": updates}


def through_browser(url: str, prompt: str, mode: str, max_new_tokens: int, expected_tokens: int) -> dict:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.locator("#mode input[value=vanilla]").wait_for(timeout=60_000)
        page.locator(f"#mode input[value={mode}]").check()
        box = page.locator("label:has-text('Max new tokens')").locator("..").locator("input[type=number]").first
        box.fill(str(max_new_tokens))
        box.press("Enter")
        page.locator("#new-chat").click()
        # the page opened with the chat the client above wrote, whose panel shows the count this run expects:
        # wait for New chat to clear it, or the wait below could end on that count before this reply started
        try:
            page.wait_for_function("['', '-'].includes(document.querySelector('#stat-tokens')?.innerText.trim() ?? '')", timeout=60_000)
        except PlaywrightTimeout as error:
            raise KestrelError("the page did not start a new chat within 60 s (New chat pressed)") from error
        page.locator("#message textarea").fill(prompt)
        page.locator("#send").click()
        settled(page, expected_tokens)
        tokens = int(page.locator("#stat-tokens").inner_text())
        rate = float(page.locator("#stat-tps").inner_text())
        browser.close()
    return {"tokens": tokens, "tokens_per_s": rate}


# Checked inside the page, a few times a second: asking from Python through
# Playwright 20 times a second cost the browser and its driver enough CPU to
# slow the decoding that shares the cores (about 5-10% in Chromium's ratio),
# which a user's browser does not pay.
SETTLED = """([expected, quiet]) => {
    const shown = document.querySelector('#stat-tokens')?.innerText ?? null;
    const now = performance.now();
    const state = window.__kestrelSettled ??= {last: null, since: now};
    if (shown === expected) return true;
    if (shown !== state.last) { state.last = shown; state.since = now; return false; }
    return shown !== null && now - state.since > quiet * 1000;
}"""


def settled(page, expected_tokens: int, quiet: float = 3.0, timeout: float = 600) -> None:
    """Wait until the page shows `expected_tokens` (the chat command's count for
    the same greedy reply), or its count has not changed for `quiet` seconds."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(SETTLED, arg=[str(expected_tokens), quiet], polling=250, timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise KestrelError("the page's reply did not finish in time") from None
    time.sleep(0.5)  # the final update carries the same statistics


def format_rows(rows: list[dict]) -> str:
    """Median tokens/s and median ratio to the chat command per way and mode."""
    lines = [f"{'way':<32} {'mode':<8} {'tokens':>6} {'tokens/s':>9} {'vs chat':>8}  (median of {max(r['round'] for r in rows)} rounds)"]
    for way in dict.fromkeys(row["way"] for row in rows):
        for mode in dict.fromkeys(row["mode"] for row in rows):
            group = [row for row in rows if row["way"] == way and row["mode"] == mode]
            if group:
                rate = statistics.median(row["tokens_per_s"] for row in group)
                ratio = statistics.median(row["vs_chat_command"] for row in group)
                counts = sorted({row["tokens"] for row in group})  # the same each round, unless a reply differed
                tokens = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
                lines.append(f"{way:<32} {mode:<8} {tokens:>6} {rate:>9.1f} {ratio:>7.2f}x")
    return "\n".join(lines)
