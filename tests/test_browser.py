"""The app in a real headless Chromium: chat streaming with live stats,
exports downloaded through the page, Compare, HTML escaping, and a
screenshot of each tab in test-artifacts/."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from models.errors import KestrelError

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
STEP_DELAY = 0.02  # seconds added per decode step, so that streaming is visible

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium)"
)


@pytest.fixture(scope="module")
def served(tiny_base, data_dir):
    """The running app: its address and its runtime (whose queue a test can hold, as a busy model would)."""
    from app.runtime import Runtime
    from app.server import Server
    from app.ui import build_app
    from core.engine import Engine
    from tests.factory import random_head

    class SlowEngine(Engine):
        def stream(self, *args, **kwargs):
            for step in super().stream(*args, **kwargs):
                time.sleep(STEP_DELAY)
                yield step

    engine = SlowEngine(tiny_base, random_head(tiny_base.model))
    runtime = Runtime(engine)
    server = Server(build_app(runtime, data_dir), runtime, port=7990)
    yield server.start(), runtime
    server.close()


@pytest.fixture(scope="module")
def app_url(served):
    return served[0]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("browser-data")


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url)
    # the page-load event restores saved settings: wait for it before changing any
    page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
    yield page
    page.close()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def settings(page, max_new_tokens: int) -> None:
    box = page.locator("label:has-text('Max new tokens')").locator("..").locator("input[type=number]").first
    box.fill(str(max_new_tokens))
    box.press("Enter")


def send(page, text: str) -> None:
    page.locator("#message textarea").fill(text)
    page.locator("#send").click()


def assistant_text(page) -> str:
    bubbles = page.locator("#chatbot .message-row.bot-row, #chatbot [data-testid='bot']")
    return bubbles.last.inner_text() if bubbles.count() else ""


def test_chat_streams_reply_and_live_stats(page):
    settings(page, 80)
    before = page.locator("#stat-tps").inner_text()
    send(page, "w1 w2 w3")
    lengths, rates, deadline = set(), set(), time.monotonic() + 60
    while time.monotonic() < deadline:
        lengths.add(len(assistant_text(page)))
        rates.add(page.locator("#stat-tps").inner_text())
        if page.locator("#stat-tokens").count() and page.locator("#stat-tokens").inner_text() == "80":
            break
        time.sleep(0.03)
    assert len(lengths - {0}) >= 2, f"the reply should grow while streaming (lengths seen: {sorted(lengths)})"
    assert before == "-" and len(rates - {"-"}) >= 2, f"tokens/s should update live (seen {rates})"
    assert page.locator("#stat-tau").inner_text() != "-"
    assert float(page.locator("#stat-tau-session").inner_text()) >= 1.0
    nodes, depth = (float(part) for part in page.locator("#stat-tree-mean").inner_text().split(" / "))
    assert nodes >= 1.0 and depth >= 0.0
    # the calibration plot draws the measured series in a colour of its own beside the diagonal: the
    # page's plot fixes its colours at its first value, which once left the measured line without one
    page.wait_for_function(
        """() => {
            const marks = [...document.querySelectorAll('#calibration-plot path[aria-label]')];
            const stroke = (series) => marks.filter((m) => m.getAttribute('aria-label').includes('series: ' + series))
                .map((m) => m.getAttribute('stroke')).find((colour) => colour && colour !== 'none');
            return stroke('measured') && stroke('diagonal') && stroke('measured') !== stroke('diagonal');
        }""",
        timeout=10_000,
    )
    # draft depths are labels 1, 2, ...: the chart's axis type is fixed at its first, empty value,
    # which once made it a number axis (ticks 0, 1, ... or 0.5, 1.5, ..., bars between them)
    page.wait_for_function(
        """() => {
            const labels = [...document.querySelectorAll('#depth-plot svg text')].map((t) => t.textContent.trim());
            return labels.includes('1') && labels.includes('2') && !labels.includes('0') && !labels.includes('1.5');
        }""",
        timeout=10_000,
    )
    screenshot(page, "chat")
    # a reload draws the charts of the chat's last reply again, from its saved figures
    page.reload()
    page.wait_for_function(
        """() => {
            const labels = [...document.querySelectorAll('#depth-plot svg text')].map((t) => t.textContent.trim());
            const measured = [...document.querySelectorAll('#calibration-plot path[aria-label]')]
                .filter((m) => m.getAttribute('aria-label').includes('series: measured'));
            return labels.includes('1') && labels.includes('2') && measured.length > 0
                && document.querySelectorAll('#rate-plot path[aria-label]').length > 0;
        }""",
        timeout=15_000,
    )


def test_depth_chart_in_depth_order_after_the_tab_came_back_mid_reply(page):
    """A reply whose context branch drafts past depth 9, with the Models tab
    opened and closed while it streams: the reply ends, and the depth chart
    lists its depths in order (sorted as text, 10 and up stood between 1 and 2)."""
    settings(page, 200)
    send(page, "w1 w2 w4")
    page.locator("#stat-tokens").wait_for(timeout=30_000)
    for _ in range(2):
        page.get_by_role("tab", name="Models").click()
        time.sleep(0.3)
        page.get_by_role("tab", name="Chat").click()
        time.sleep(0.3)
    page.get_by_text(re.compile("The reply reached the (token limit|context window)")).wait_for(timeout=60_000)
    ticks = page.locator("#depth-plot svg [aria-label^='X-axis'] text").evaluate_all("(ts) => ts.map((t) => t.textContent.trim())")
    depths = [int(tick) for tick in ticks if tick.isdigit()]
    assert len(depths) >= 10 and depths == sorted(depths), ticks


def test_stop_button_ends_the_reply(page):
    settings(page, 200)
    send(page, "w6 w7")
    page.wait_for_function("document.querySelector('#stat-tokens') && +document.querySelector('#stat-tokens').innerText > 5")
    page.locator("#stop").click()
    page.locator("#notice").get_by_text("Stopped").wait_for(timeout=5_000)
    assert int(page.locator("#stat-tokens").inner_text()) < 200


def test_regenerate_while_a_reply_is_written_is_refused_at_once(page, data_dir):
    """Regenerate waits for the model behind the reply being written: it says
    so at once instead, and the reply is neither replaced nor lost."""
    settings(page, 200)
    page.locator("#new-chat").click()
    send(page, "w2 w3")
    page.wait_for_function("document.querySelector('#stat-tokens') && +document.querySelector('#stat-tokens').innerText > 5")
    page.locator("#regenerate").click()
    page.locator("#notice").get_by_text("A reply is being written").wait_for(timeout=3_000)
    page.locator("#stop").click()
    page.locator("#notice").get_by_text("Stopped").wait_for(timeout=5_000)
    time.sleep(0.5)  # a regeneration that had waited for the model would have started by now
    assert "Stopped" in page.locator("#notice").inner_text()
    saved = [json.loads(path.read_text()) for path in (data_dir / "chats").glob("*.json")]
    kept = [chat for chat in saved if chat["messages"] and chat["messages"][0]["content"] == "w2 w3"]
    assert len(kept) == 1 and kept[0]["messages"][-1]["stats"]["finish_reason"] == "cancelled"
    settings(page, 6)
    page.locator("#regenerate").click()  # with no reply being written it regenerates
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        chats = [json.loads(path.read_text()) for path in (data_dir / "chats").glob(f"{kept[0]['id']}.json")]
        if chats and chats[0]["messages"][-1]["stats"]["finish_reason"] == "length":
            break
        time.sleep(0.1)
    assert chats[0]["messages"][-1]["stats"]["tokens"] == 6 and len(chats[0]["messages"]) == 2
    assert chats[0]["messages"][-1]["earlier"][0]["stats"]["finish_reason"] == "cancelled"  # the replaced reply is kept
    page.locator("#earlier-reply").click()  # and shown again
    page.locator("#notice").get_by_text("2 are kept for this message").wait_for(timeout=10_000)
    chat = json.loads((data_dir / "chats" / f"{kept[0]['id']}.json").read_text())
    assert chat["messages"][-1]["content"] == kept[0]["messages"][-1]["content"]
    assert " ".join(kept[0]["messages"][-1]["content"].split())[:20] in " ".join(assistant_text(page).split())


def test_send_or_enter_while_a_reply_is_written_is_refused_and_keeps_the_text(page, data_dir):
    """Both say so at once and leave the typed text in the box; nothing is sent when the
    reply ends (Enter used to queue the text silently and send it then, Send did nothing)."""
    settings(page, 200)
    box = page.locator("#message textarea")
    for number, press in enumerate((lambda: page.locator("#send").click(), lambda: box.press("Enter"))):
        page.locator("#new-chat").click()
        send(page, f"w4 w{number}")
        page.wait_for_function("document.querySelector('#stat-tokens') && +document.querySelector('#stat-tokens').innerText > 5")
        box.fill("w6 w7")
        press()
        page.locator("#notice").get_by_text("A reply is being written").wait_for(timeout=3_000)
        # and as a toast, which the reply's next frames cannot redraw
        page.locator("[data-testid='toast-body']").get_by_text("A reply is being written").first.wait_for(timeout=3_000)
        assert box.input_value() == "w6 w7"
        page.locator("#stop").click()
        page.locator("#notice").get_by_text("Stopped.").wait_for(timeout=5_000)
        time.sleep(1.0)  # a queued send would have started by now
        assert box.input_value() == "w6 w7" and page.locator("#notice").inner_text().strip() == "Stopped."
        saved = [json.loads(path.read_text()) for path in (data_dir / "chats").glob("*.json")]
        kept = [chat for chat in saved if chat["messages"] and chat["messages"][0]["content"] == f"w4 w{number}"]
        assert len(kept) == 1 and [m["role"] for m in kept[0]["messages"]] == ["user", "assistant"]
    # Edit would put the last message in the box in place of the typed text: refused, the text kept
    page.locator("#edit").click()
    page.locator("#notice").get_by_text("holds text that Edit would replace").wait_for(timeout=5_000)
    assert box.input_value() == "w6 w7"
    box.fill("")
    page.locator("#edit").click()  # an empty box takes the message
    page.wait_for_function("document.querySelector('#message textarea').value === 'w4 w1'", timeout=5_000)
    box.fill("")


def test_a_message_stopped_while_it_waits_comes_back_before_the_text_typed_since(page, served):
    """Behind a request the page's own queue does not hold back (an API client's),
    the message says it waits; stopped there, it comes back to the box ahead of
    what was typed meanwhile, which is kept (it was replaced). The notice line is
    a live region, so a screen reader says it."""
    runtime = served[1]
    settings(page, 4)
    page.locator("#new-chat").click()
    box = page.locator("#message textarea")
    with runtime.queue.turn():  # the model is busy
        send(page, "w1 w2")
        page.locator("#notice").get_by_text("Waiting for the model").wait_for(timeout=5_000)
        time.sleep(1.0)  # the reply's own first frame has come by now: it says so too
        assert "Waiting for the model" in page.locator("#notice").inner_text()
        box.fill("w3 w4")
        page.locator("#stop").click()
        time.sleep(0.5)
    page.locator("#notice").get_by_text("Stopped before the reply started").wait_for(timeout=10_000)
    page.wait_for_function("document.querySelector('#message textarea').value === 'w1 w2\\n\\nw3 w4'", timeout=5_000)
    assert page.locator("#notice").get_attribute("role") == "status"
    box.fill("")


def test_send_pressed_twice_sends_the_message_once(page, data_dir):
    """A double click on Send (or Enter twice) sends once: the second press had
    found the first's message saved and gone on as a copy of the chat."""
    settings(page, 4)
    page.locator("#new-chat").click()
    send(page, "w5 w6")
    page.wait_for_function("document.querySelector('#stat-tokens') && document.querySelector('#stat-tokens').innerText === '4'")
    page.locator("#message textarea").fill("w7 w8")
    page.locator("#send").dblclick()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        saved = [json.loads(path.read_text()) for path in (data_dir / "chats").glob("*.json")]
        ours = [chat for chat in saved if chat["messages"] and chat["messages"][0]["content"] == "w5 w6"]
        if any(len(chat["messages"]) == 4 for chat in ours):
            break
        time.sleep(0.1)
    time.sleep(1.0)  # a second reply would have started by now
    saved = [json.loads(path.read_text()) for path in (data_dir / "chats").glob("*.json")]
    ours = [chat for chat in saved if chat["messages"] and chat["messages"][0]["content"] == "w5 w6"]
    assert len(ours) == 1 and [m["role"] for m in ours[0]["messages"]] == ["user", "assistant"] * 2, ours
    assert "another tab" not in page.locator("#notice").inner_text()
    assert page.locator("[data-testid='toast-body']").count() == 0  # the second press ends unseen
    screenshot(page, "double-send")


def first_exchange(page, url: str) -> None:
    """Open the page and have "w1 w2" answered with 4 tokens."""
    page.goto(url)
    page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
    settings(page, 4)
    send(page, "w1 w2")
    page.wait_for_function("document.querySelector('#stat-tokens') && document.querySelector('#stat-tokens').innerText === '4'")


def test_a_page_open_across_a_server_restart_goes_on_with_its_chat(browser, tiny_base, tmp_path):
    """The server's chat state goes with it; the page keeps the id of the chat
    it shows, so Send continues that chat (it started a new one without the
    earlier turns), an edited message replaces the exchange Edit took back
    (it followed it), and the chatbot's trash icon clears the chat (it found none)."""
    from app.runtime import Runtime
    from app.server import Server
    from app.ui import build_app
    from core.engine import Engine
    from tests.factory import random_head

    engine = Engine(tiny_base, random_head(tiny_base.model))

    def serve():
        runtime = Runtime(engine)
        server = Server(build_app(runtime, tmp_path), runtime, port=7993)
        return server, server.start()

    server, url = serve()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        first_exchange(page, url)
        server.close()
        server, again = serve()
        assert again == url
        time.sleep(3)  # the page notices the server is back
        send(page, "w3 w4")
        chats = saved_chats(tmp_path, 4)
        assert len(chats) == 1 and [m["content"] for m in chats[0]["messages"] if m["role"] == "user"] == ["w1 w2", "w3 w4"]
        page.wait_for_function("document.querySelector('#stat-tokens') && document.querySelector('#stat-tokens').innerText === '4'")
        page.locator("#edit").click()  # "w3 w4" back in the box; its exchange stays saved until the edited message is sent
        page.wait_for_function("document.querySelector('#taken-back textarea').value !== ''")
        server.close()
        server, _ = serve()
        time.sleep(3)
        send(page, "w5")  # in place of "w3 w4" and its reply, though the server lost what Edit took back
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ((saved := saved_chats(tmp_path, 4)[0]["messages"])[-1]["role"] == "assistant"
                                                   and "w5" in [m["content"] for m in saved]):  # fmt: skip
            time.sleep(0.2)
        assert [m["content"] for m in saved if m["role"] == "user"] == ["w1 w2", "w5"]
        server.close()
        server, _ = serve()
        time.sleep(3)
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator("#chatbot button[aria-label='Clear']").click()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ids(tmp_path):
            time.sleep(0.2)
        assert ids(tmp_path) == []  # the saved chat cleared, as the page showed it
    finally:
        page.close()
        server.close()


def test_a_page_of_another_version_is_told_to_reload_and_loses_nothing(browser, tiny_base, tmp_path):
    """A page opened before Kestrel restarted as another version (an upgrade) names
    its events by numbers the new server gives to other handlers. Gradio's page
    reloads itself once it notices the restart, but a Send before that is refused:
    the page says to reload, the message stays in the box and the saved chat is
    unchanged; after Reload the message is sent and continues the chat."""
    from app.runtime import Runtime
    from app.server import Server
    from app.ui import build_app
    from core.engine import Engine
    from tests.factory import random_head

    runtime = Runtime(Engine(tiny_base, random_head(tiny_base.model)))
    server = Server(build_app(runtime, tmp_path), runtime, port=7994)
    url = server.start()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        first_exchange(page, url)
        served_version, server.app.version = server.app.version, "a later version"  # as if restarted as another version
        send(page, "w3 w4")
        banner = page.locator("#stale-page")
        banner.wait_for(timeout=30_000)
        assert "another version" in banner.inner_text() and "reload the page" in banner.inner_text()
        assert page.locator("#stale-page button").is_visible()
        screenshot(page, "stale-page")
        time.sleep(1)
        assert page.locator("#message textarea").input_value() == "w3 w4"
        chats = saved_chats(tmp_path, 2)
        assert [[m["content"] for m in chat["messages"] if m["role"] == "user"] for chat in chats] == [["w1 w2"]]
        server.app.version = served_version  # the page the reload brings is of the server's version
        page.locator("#stale-page button").click()
        page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        assert page.locator("#stale-page").count() == 0
        page.wait_for_function("document.querySelector('#message textarea').value === 'w3 w4'")  # kept across the reload
        page.locator("#send").click()
        chats = saved_chats(tmp_path, 4)
        assert [[m["content"] for m in chat["messages"] if m["role"] == "user"] for chat in chats] == [["w1 w2", "w3 w4"]]
    finally:
        page.close()
        server.close()


def test_a_page_whose_state_the_server_let_go_goes_on_with_its_chat(browser, tiny_base, tmp_path, monkeypatch):
    """Past PAGE_SESSIONS_KEPT pages the server drops the least recently used one's state:
    that page's next message continues the chat it shows, as after a restart."""
    from app import server as server_module
    from app.runtime import Runtime
    from app.server import Server
    from app.ui import build_app
    from core.engine import Engine
    from tests.factory import random_head

    monkeypatch.setattr(server_module, "PAGE_SESSIONS_KEPT", 1)
    runtime = Runtime(Engine(tiny_base, random_head(tiny_base.model)))
    demo = build_app(runtime, tmp_path)
    server = Server(demo, runtime, port=7994)
    url = server.start()
    first, second = (browser.new_page(viewport={"width": 1400, "height": 1000}) for _ in range(2))
    try:
        first_exchange(first, url)
        first.wait_for_function("document.querySelector('#shown-chat-id textarea').value !== ''")  # the reply's last step
        kept = set(demo.state_holder.session_data)
        second.goto(url)  # a second page's session: the first page's state is let go
        second.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        # its load's last step (it shows the chat last written in): from here on only the first page's events come
        second.wait_for_function("document.querySelector('#shown-chat-id textarea').value !== ''")
        time.sleep(1)
        assert kept and not kept & set(demo.state_holder.session_data)
        send(first, "w3 w4")
        chats = saved_chats(tmp_path, 4)
        assert len(chats) == 1 and [m["content"] for m in chats[0]["messages"] if m["role"] == "user"] == ["w1 w2", "w3 w4"]
        first.locator("#notice").get_by_text("token limit").wait_for(timeout=30_000)  # the reply has ended
        # let go again: the saved chats it lists still open (Gradio checked the choice against the state's empty list)
        first.wait_for_function("document.querySelector('#shown-chat-id textarea').value !== ''")
        first.locator("#new-chat").click()
        first.wait_for_function("!document.querySelector('#chatbot').innerText.includes('w3 w4')")
        second.reload()
        second.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        second.wait_for_function("document.querySelector('#shown-chat-id textarea').value !== ''")
        time.sleep(1)
        first.get_by_text("Saved chats").click()
        first.locator("#chats input").click()
        first.get_by_role("option", name="w1 w2").first.click()
        first.wait_for_function("document.querySelector('#chatbot').innerText.includes('w3 w4')", timeout=15_000)
        assert first.locator(".toast-body").count() == 0
    finally:
        first.close()
        second.close()
        server.close()


def ids(folder: Path) -> list[str]:
    return [path.stem for path in (folder / "chats").glob("*.json")]


def saved_chats(folder: Path, messages: int) -> list[dict]:
    """The chats saved in `folder`, once they hold `messages` messages in all (or after 30 s)."""
    from app.store import Store

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(len(c["messages"]) for c in map(Store(folder).load_chat, ids(folder))) < messages:
        time.sleep(0.2)
    return [Store(folder).load_chat(chat_id) for chat_id in ids(folder)]


def test_the_chat_fits_a_small_window_and_its_buttons_cover_no_message(page):
    """At 1280x720 the message box, Send and the buttons below stay in view, and the
    chat's own clear and copy-all buttons sit above the messages, not over them."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.locator("#new-chat").click()
    settings(page, 8)
    send(page, "w1 w2 w3 " * 12)
    page.wait_for_function("() => !['', '-'].includes(document.querySelector('#stat-tokens')?.innerText.trim())", timeout=60_000)
    page.evaluate("() => window.scrollTo(0, 0)")  # setting the token limit scrolled the page to it
    for selector in ("#message", "#send", "#stop", "#new-chat"):
        box = page.locator(selector).bounding_box()
        assert box and box["y"] >= 0 and box["y"] + box["height"] <= 720, (selector, box)
    # above the area the messages scroll in, so that no scrolled message passes under them
    toolbar = page.locator("#chatbot .icon-button-wrapper.top-panel").bounding_box()
    messages = page.locator("#chatbot .bubble-wrap").bounding_box()
    assert toolbar and messages, (toolbar, messages)
    assert toolbar["y"] + toolbar["height"] <= messages["y"] + 1, (toolbar, messages)


def test_a_setting_typed_out_of_range_gets_no_unnamed_error(page):
    """Typing into a slider's box sends each value as typed: Gradio's own check
    answered "Value 5 is greater than maximum value 2." in toasts that named no
    setting. The box itself brings the value back into range when it is left,
    and a note under the slider says so by name; a value that reaches a reply
    out of range is named (test_ui)."""
    settings(page, 4)
    box = page.locator("label:has-text('Temperature')").locator("..").locator("input[type=number]").first
    box.fill("5")
    time.sleep(1.5)  # the settings are saved on each input
    assert page.locator(".toast-body").all_inner_texts() == []
    box.press("Enter")
    page.locator("#message textarea").click()  # leaving the box brings it back into range, and says so
    page.wait_for_function("v => v.value === '2'", arg=box.element_handle(), timeout=5_000)
    note = page.locator(".kestrel-range-note")
    assert note.count() == 1 and note.inner_text() == "Temperature: 5 is above the highest value, so it is set to 2."
    box.fill("0")
    box.press("Enter")
    page.locator("#message textarea").click()
    time.sleep(0.5)
    assert page.locator(".toast-body").all_inner_texts() == [] and note.count() == 0
    depth = page.locator("label:has-text('Tree: depth')").locator("..").locator("input[type=number]").first
    depth.fill("-3")
    page.locator("#message textarea").click()
    page.wait_for_function("v => v.value === '1'", arg=depth.element_handle(), timeout=5_000)
    assert note.inner_text() == "Tree: depth: -3 is below the lowest value, so it is set to 1."
    depth.fill("8")
    page.locator("#message textarea").click()
    note.wait_for(state="detached", timeout=5_000)


def test_user_and_model_text_is_escaped(page):
    settings(page, 4)
    send(page, "<script>window.kestrelInjected = 1</script><b>not bold</b>")
    page.locator("#chatbot").get_by_text("<script>window.kestrelInjected", exact=False).wait_for(timeout=15_000)
    assert page.evaluate("window.kestrelInjected") is None
    assert page.locator("#chatbot b:has-text('not bold')").count() == 0


def test_a_chat_s_next_turn_keeps_the_last_turn_s_tokens(page):
    """The panel says how many prompt tokens a reply kept from the last one:
    the second turn keeps the first turn's prompt and reply."""
    settings(page, 4)
    page.locator("#new-chat").click()
    send(page, "w21 w22 w23")
    page.wait_for_function("document.querySelector('#stat-reused') && document.querySelector('#stat-tokens').innerText === '4'")
    first = int(page.locator("#stat-reused").inner_text())  # what it shares with an earlier test's chat, if any
    send(page, "w24 w25")
    page.wait_for_function(f"+document.querySelector('#stat-reused')?.innerText > {first + 3}", timeout=30_000)


def test_clear_and_delete_ask_first_and_delete_empties_the_panel(page, data_dir):
    from app.store import Store

    settings(page, 4)
    page.locator("#new-chat").click()
    send(page, "w11 w12")
    page.wait_for_function("document.querySelector('#stat-tokens') && document.querySelector('#stat-tokens').innerText === '4'")
    asked = []

    def answer(dialog, accept: bool):
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", lambda dialog: answer(dialog, False))
    page.locator("#clear").click()
    time.sleep(1.0)
    assert "Clear this chat?" in asked[-1] and "w11 w12" in page.locator("#chatbot").inner_text()
    assert any(chat["title"] == "w11 w12" for chat in Store(data_dir).list_chats())  # dismissed: nothing deleted
    asked.clear()
    page.once("dialog", lambda dialog: answer(dialog, False))
    page.locator("#chatbot button[aria-label='Clear']").click()  # the chatbot's own trash icon empties the view first
    page.wait_for_function("document.querySelector('#chatbot').innerText.includes('w11 w12')", timeout=10_000)
    assert asked and "Clear this chat?" in asked[-1]  # the same question, and the chat shown again
    assert any(chat["title"] == "w11 w12" for chat in Store(data_dir).list_chats())
    page.get_by_text("Saved chats").click()
    page.once("dialog", lambda dialog: answer(dialog, True))
    page.locator("#delete").click()
    page.wait_for_function("!document.querySelector('#chatbot').innerText.includes('w11 w12')", timeout=10_000)
    assert "Delete this chat?" in asked[-1] and page.locator("#stat-tokens").count() == 0
    assert page.locator("#stat-tps").inner_text() == "-"
    assert not any(chat["title"] == "w11 w12" for chat in Store(data_dir).list_chats())
    kept = page.evaluate("JSON.stringify(Object.assign({}, localStorage)) + JSON.stringify(Object.assign({}, sessionStorage))")
    assert "w11 w12" not in kept  # Gradio's run history would keep the deleted chat's text in the browser


def test_a_chat_is_renamed_from_saved_chats_and_keeps_its_name(page, data_dir):
    from app.store import Store

    saved_chat_of(page, "w6 w7")
    assert page.locator("#chat-name textarea, #chat-name input").first.input_value() == ""
    box = page.locator("#chat-name textarea, #chat-name input").first
    box.fill("Holiday plans")
    page.locator("#rename").click()
    page.wait_for_function("document.querySelector('#chats input').value.startsWith('Holiday plans (')", timeout=15_000)
    chat_id = page.locator("#shown-chat-id textarea").input_value()
    assert Store(data_dir).load_chat(chat_id)["name"] == "Holiday plans"
    page.locator("#new-chat").click()  # another chat shown: its own (empty) name
    page.wait_for_function("document.querySelector('#chat-name textarea, #chat-name input').value === ''", timeout=15_000)
    page.locator("#chats input").click()
    page.get_by_role("option", name=re.compile("^Holiday plans")).click()  # opened again: its name back in the box
    page.wait_for_function("document.querySelector('#chat-name textarea, #chat-name input').value === 'Holiday plans'", timeout=15_000)
    assert "w6 w7" in page.locator("#chatbot").inner_text()
    box.fill("x" * 101)
    box.press("Enter")  # Enter renames too; too long: said, the name kept
    page.wait_for_function("document.querySelector('#notice').innerText.includes('at most 100 characters')", timeout=15_000)
    assert Store(data_dir).load_chat(chat_id)["name"] == "Holiday plans"
    box.fill("")
    page.locator("#rename").click()  # emptied: named by its first message again
    page.wait_for_function("document.querySelector('#chats input').value.startsWith('w6 w7 (')", timeout=15_000)
    assert "name" not in Store(data_dir).load_chat(chat_id)


def saved_chat_of(page, message: str) -> None:
    """A new chat of `message` and its 4-token reply, with Saved chats opened."""
    settings(page, 4)
    page.locator("#new-chat").click()
    page.wait_for_function("!document.querySelector('#chatbot').innerText.includes('w1')")
    send(page, message)
    page.wait_for_function("document.querySelector('#stat-tokens') && document.querySelector('#stat-tokens').innerText === '4'")
    page.get_by_text("Saved chats").click()


def test_export_downloads_markdown_and_json(page, data_dir):
    saved_chat_of(page, "w4 w5")
    page.locator("#export").click()
    links = page.locator("#exported a[href]")
    links.nth(1).wait_for(timeout=15_000)
    bodies = {}
    for index in range(links.count()):
        href = links.nth(index).get_attribute("href")
        response = page.request.get(href if href.startswith("http") else page.url.rstrip("/") + "/" + href.lstrip("/"))
        assert response.ok, f"{href}: {response.status}"
        bodies[href.rsplit(".", 1)[-1]] = response.text()
    assert "**User:**\n\n> w4 w5" in bodies["md"]
    exported = json.loads(bodies["json"])
    assert [message["content"] for message in exported["messages"]][0] == "w4 w5"
    saved = json.loads((data_dir / "chats" / f"{exported['id']}.json").read_text())
    assert exported["title"] == saved["title"] == "w4 w5" and exported["updated"] == saved["updated"]  # as the saved file has them
    # the page keeps the id of the chat shown, by which Send after a server restart continues it
    assert page.locator("#shown-chat-id textarea").input_value() == exported["id"]
    assert page.locator("#chats input").input_value().startswith("w4 w5")  # the chat shown is the one ticked in Saved chats
    page.locator("#system textarea").press_sequentially("w3 w2")  # typed for this saved chat, not sent: a reload gives it back
    page.wait_for_timeout(1500)
    page.reload()
    page.wait_for_function("document.querySelector('#system textarea')?.value === 'w3 w2'", timeout=30_000)
    page.wait_for_function(f"document.querySelector('#shown-chat-id textarea')?.value === {json.dumps(exported['id'])}", timeout=15_000)
    page.locator("#system textarea").fill("")
    page.locator("#message textarea").click()
    page.wait_for_timeout(1500)
    page.locator("#new-chat").click()  # another chat shown: the exported files of this one are no longer listed
    page.wait_for_function("document.querySelectorAll('#exported a[href]').length === 0", timeout=15_000)
    page.locator("#system textarea").press_sequentially("w9 w8")  # typed, never left: kept by a reload all the same
    page.wait_for_timeout(1500)
    page.reload()
    page.locator("#system textarea").wait_for()
    page.wait_for_function("document.querySelector('#system textarea').value === 'w9 w8'", timeout=15_000)
    page.locator("#system textarea").fill("")  # the next tests' chats have no system prompt (saved as the box is left)
    page.locator("#message textarea").click()
    page.wait_for_timeout(1500)


def test_a_chat_s_export_is_imported_through_the_page(page, data_dir, tmp_path):
    saved_chat_of(page, "w6 w7")
    chat_id = page.locator("#shown-chat-id textarea").input_value()
    backup = tmp_path / "backup.json"
    backup.write_text((data_dir / "chats" / f"{chat_id}.json").read_text(encoding="utf-8"), encoding="utf-8")
    page.locator("#new-chat").click()
    page.wait_for_function("!document.querySelector('#chatbot').innerText.includes('w6')")
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(backup))
    page.wait_for_function("document.querySelector('#notice').innerText.includes('Imported backup.json')", timeout=15_000)
    assert '"w6 w7"' in page.locator("#notice").inner_text()
    page.wait_for_function("document.querySelector('#chatbot').innerText.includes('w6 w7')", timeout=15_000)
    saved = [json.loads(path.read_text()) for path in (data_dir / "chats").glob("*.json")]
    copies = [chat for chat in saved if chat["messages"] == json.loads(backup.read_text())["messages"] and chat["id"] != chat_id]
    assert len(copies) == 1  # saved once, under an id of its own (the original's is taken), and shown
    page.wait_for_function(f"document.querySelector('#shown-chat-id textarea').value === '{copies[0]['id']}'", timeout=15_000)
    assert (data_dir / "chats" / f"{chat_id}.json").exists()  # the chat it was exported from is left as it is
    backup.write_text("{not json", encoding="utf-8")
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(backup))
    page.wait_for_function("document.querySelector('#notice').innerText.includes('not valid JSON')", timeout=15_000)
    assert "nothing was imported" in page.locator("#notice").inner_text()


def test_text_typed_but_not_sent_survives_a_reload(page, data_dir):
    """The message box and Compare's prompt as typed come back after a reload, in this tab
    (sessionStorage); a message sent leaves nothing to bring back."""
    settings(page, 4)
    page.locator("#message textarea").press_sequentially("w7 w6")
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-prompt textarea").press_sequentially("w5 w4")
    page.reload()
    page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
    page.wait_for_function("document.querySelector('#message textarea').value === 'w7 w6'", timeout=15_000)
    page.get_by_role("tab", name="Compare").click()
    page.wait_for_function("document.querySelector('#compare-prompt textarea').value === 'w5 w4'", timeout=15_000)
    page.get_by_role("tab", name="Chat").click()
    page.locator("#new-chat").click()
    page.wait_for_function("['', '-'].includes(document.querySelector('#stat-tokens')?.innerText.trim() ?? '')", timeout=15_000)  # the reloaded chat's figures gone
    page.locator("#send").click()
    page.wait_for_function("!['', '-'].includes(document.querySelector('#stat-tokens')?.innerText.trim())", timeout=60_000)
    deadline = time.monotonic() + 30  # the reply saved whole: it has ended (a reload before would cut it short)
    while time.monotonic() < deadline and not any(
        chat["messages"][-1]["role"] == "assistant" and chat["messages"][-1]["stats"]["finish_reason"] != "interrupted"
        for chat in saved_chats(data_dir, 0) if [m["content"] for m in chat["messages"][:1]] == ["w7 w6"]
    ):  # fmt: skip
        time.sleep(0.2)
    page.wait_for_timeout(1000)  # and its last steps have run
    assert page.locator("#message textarea").input_value() == ""
    page.reload()
    page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
    page.wait_for_timeout(1000)
    assert page.locator("#message textarea").input_value() == ""
    # a message Edit put back is not brought back: the reloaded chat still has that exchange, which Send would repeat
    page.locator("#edit").click()
    page.wait_for_function("document.querySelector('#message textarea').value === 'w7 w6'", timeout=15_000)
    page.wait_for_timeout(500)
    page.reload()
    page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
    page.wait_for_timeout(1000)
    assert page.locator("#message textarea").input_value() == ""
    # and what is typed next comes back again (the mark had stayed, and took it too)
    page.locator("#message textarea").press_sequentially("w3 w2")
    page.wait_for_timeout(500)
    page.reload()
    page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
    page.wait_for_function("document.querySelector('#message textarea').value === 'w3 w2'", timeout=15_000)
    page.locator("#message textarea").fill("")
    page.get_by_role("tab", name="Compare").click()
    assert page.locator("#compare-prompt textarea").input_value() == "w5 w4"
    page.locator("#compare-prompt textarea").fill("")  # the next tests type their own


def test_compare_shows_both_panes_and_verdict(page):
    settings(page, 30)  # the Chat tab's settings apply to Compare
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-prompt textarea").fill("w4 w5")
    page.locator("#compare-prompt textarea").press("Enter")  # as Compare does
    page.locator("#verdict").wait_for(timeout=60_000)
    assert page.locator("#pane-vanilla .kestrel-pane").inner_text().strip()
    assert page.locator("#pane-eagle2 .kestrel-pane").inner_text().strip()
    assert "identical to vanilla" in page.locator("#verdict").inner_text()
    assert page.locator("#verdict-speedup").inner_text().endswith("x")
    page.get_by_text("Benchmark", exact=True).click()
    limit = page.locator("#bench-limit input[type=number]")
    limit.fill("1")
    limit.press("Enter")
    page.locator("#bench-run").click()
    page.locator("#bench-table").get_by_text("EAGLE-2").wait_for(timeout=60_000)
    assert "identical to vanilla on 100%" in page.locator("#bench-notice").inner_text()
    # built when the tab was first opened, its notices are live regions too (a screen reader says them)
    assert page.locator("#bench-notice").get_attribute("role") == page.locator("#verdict-box").get_attribute("role") == "status"
    screenshot(page, "compare")


def test_compare_stop_is_the_tabs_own_and_applies_while_waiting(page, browser, served):
    """Two browser tabs press Compare while the model is busy; the second one's
    Stop, pressed while both wait, stops its own run and not the first tab's."""
    url, runtime = served
    other = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        other.goto(url)
        other.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        for tab in (page, other):
            settings(tab, 8)
            tab.get_by_role("tab", name="Compare").click()
            tab.locator("#compare-prompt textarea").fill("w4 w5")
        with runtime.queue.turn():  # the model is busy (another reply)
            for tab in (page, other):
                tab.locator("#compare-run").click()
                # a busy 2-core machine (CI beside other jobs) can take seconds to draw a page event
                tab.locator("#verdict-box").get_by_text("Waiting for the model...").wait_for(timeout=30_000)
            other.locator("#compare-stop").click()
            other.locator("#verdict-box").get_by_text("Stopping...").wait_for(timeout=30_000)  # said before the model is free
        page.locator("#verdict-speedup").wait_for(timeout=60_000)
        other.locator("#verdict-box").get_by_text("Stopped.").wait_for(timeout=30_000)
        assert not other.locator("#pane-vanilla").inner_text().strip()
    finally:
        other.close()


def test_a_model_loaded_in_another_tab_shows_when_this_tab_is_chosen_again(page, served, tiny_base, data_dir):
    """The Models tab's description and the Chat tab's modes follow a model
    that another tab loaded after this page was opened (they kept the old one's)."""
    from core.engine import Engine

    _, runtime = served
    page.get_by_role("tab", name="Models").click()
    page.locator("#model-status").get_by_text("with an EAGLE draft head").wait_for(timeout=10_000)
    page.get_by_role("tab", name="Chat").click()
    previous = runtime.engine
    try:
        runtime.replace(lambda: Engine(tiny_base), "the same model without a head")  # as another tab's Load would
        page.get_by_role("tab", name="Models").click()
        page.locator("#model-status").get_by_text("without a draft head (vanilla only)").wait_for(timeout=10_000)
        page.get_by_role("tab", name="Chat").click()
        page.locator("#mode input[value=vanilla]:checked").wait_for(timeout=10_000)
        assert page.locator("#mode input[value=eagle2]").count() == 0
        runtime.replace(lambda: previous, "the test model")  # another tab loads the pair again: the tab's EAGLE-2 comes back
        page.get_by_role("tab", name="Models").click()
        page.locator("#model-status").get_by_text("with an EAGLE draft head").wait_for(timeout=10_000)
        page.get_by_role("tab", name="Chat").click()
        page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=10_000)
        page.locator("#mode input[value=eagle]").click()  # picked by hand: kept through the next round
        runtime.replace(lambda: Engine(tiny_base), "the same model without a head")
        page.get_by_role("tab", name="Models").click()
        page.get_by_role("tab", name="Chat").click()
        page.locator("#mode input[value=vanilla]:checked").wait_for(timeout=10_000)
        runtime.replace(lambda: previous, "the test model")
        page.get_by_role("tab", name="Models").click()
        page.get_by_role("tab", name="Chat").click()
        page.locator("#mode input[value=eagle]:checked").wait_for(timeout=10_000)
        page.locator("#mode input[value=eagle2]").click()  # the saved mode as the other tests open the page with
        deadline = time.monotonic() + 10
        while json.loads((data_dir / "settings.json").read_text()).get("mode") != "eagle2" and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        runtime.replace(lambda: previous, "the test model")


def test_a_page_opened_without_a_head_gives_the_saved_mode_back(page, served, tiny_base):
    """A page opened while the model has no head shows vanilla; once a model
    with a head is loaded (here by another tab), the Chat tab gives back the
    saved EAGLE-2 (it kept vanilla: only a mode picked by hand came back)."""
    from core.engine import Engine

    _, runtime = served
    previous = runtime.engine
    try:
        runtime.replace(lambda: Engine(tiny_base), "the same model without a head")
        page.reload()
        page.locator("#mode input[value=eagle2]").wait_for(state="detached", timeout=30_000)  # the page-load's restore
        page.locator("#mode input[value=vanilla]:checked").wait_for(timeout=10_000)
        runtime.replace(lambda: previous, "the test model")
        page.get_by_role("tab", name="Models").click()
        page.locator("#model-status").get_by_text("with an EAGLE draft head").wait_for(timeout=10_000)
        page.get_by_role("tab", name="Chat").click()
        page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=10_000)
    finally:
        runtime.replace(lambda: previous, "the test model")


def test_load_in_the_models_tab_sets_the_chat_mode(page, served, tiny_dir, data_dir):
    """The Models tab's Load, through the page: a model without a head is
    loaded, the Chat tab offers vanilla alone, and the choice is kept for the
    next start."""
    _, runtime = served
    previous = runtime.engine
    try:
        page.get_by_role("tab", name="Models").click()
        page.get_by_label("Base model (repo id as owner/name, or owner/name@REV to pin a revision; local folder or .gguf file; empty = bundled default)").fill(str(tiny_dir))
        page.get_by_role("button", name="Load", exact=True).click()
        page.get_by_text("Loaded.", exact=True).wait_for(timeout=120_000)
        page.locator("#model-status").get_by_text("without a draft head (vanilla only)").wait_for(timeout=10_000)
        kept = json.loads((data_dir / "settings.json").read_text())["model"]
        assert kept == {"model": str(tiny_dir.resolve()), "head": None, "quantization": "auto", "dtype": "auto"}
        page.get_by_role("tab", name="Chat").click()
        page.locator("#mode input[value=eagle2]").wait_for(state="detached", timeout=10_000)
        page.locator("#mode input[value=vanilla]:checked").wait_for(timeout=10_000)
    finally:
        runtime.replace(lambda: previous, "the test model")


def test_a_load_shows_its_download_s_progress_on_the_page(page, served, monkeypatch):
    """A model downloading for minutes showed only a clock on the page: its
    bars (huggingface_hub's tqdm) went to a terminal that a desktop start has
    none of. They show on the page now, with the file's name."""
    import app.library
    from tqdm.auto import tqdm

    _, runtime = served
    previous = runtime.engine

    def load_pair(*args):
        for _ in tqdm(range(60), desc="model-00001-of-00004.safetensors"):  # as huggingface_hub names a file's bar
            time.sleep(0.1)
        return previous

    monkeypatch.setattr(app.library, "load_pair", load_pair)
    monkeypatch.setattr(app.library, "prepared", lambda engine: engine)
    try:
        page.get_by_role("tab", name="Models").click()
        page.locator("#model-box textarea").fill("owner/big-model")
        page.get_by_role("button", name="Load", exact=True).click()
        page.locator("#load-notice").get_by_text("model-00001-of-00004.safetensors").wait_for(timeout=30_000)
        page.get_by_text("Loaded.", exact=True).wait_for(timeout=60_000)
    finally:
        runtime.replace(lambda: previous, "the test model")


def test_models_tab(page):
    page.get_by_role("tab", name="Models").click()
    page.get_by_text("Vicuna-13B v1.3").first.wait_for(timeout=10_000)
    assert "llama" in page.locator("#model-status").inner_text().lower() or page.locator("#model-status").inner_text()
    screenshot(page, "models")
    # a catalog entry fills the boxes; typing over them leaves the entry no longer shown as chosen
    page.locator("#catalog-entry input").click()
    page.get_by_role("option").filter(has_text="Vicuna-13B").first.click()
    page.wait_for_function("document.querySelector('#model-box textarea').value !== ''", timeout=10_000)
    assert page.locator("#catalog-entry input").input_value()
    # whether it fits this machine is said before Load (on 24 GB of RAM it does not: 13B weights read in float32 first)
    from app import library
    from models import catalog

    picked = catalog.find(page.locator("#catalog-entry input").input_value())
    warning = library.fit_warning(picked, library.detected_memory(), library.cpu_weight_bytes())
    if warning:
        page.locator("#load-notice").get_by_text(warning).wait_for(timeout=10_000)
    # the notice weighs the Quantization chosen after the entry too
    page.get_by_role("radio", name="none", exact=True).check()
    at_16_bits = library.fit_warning(picked, library.detected_memory(), library.cpu_weight_bytes(), "none")
    page.wait_for_function("text => document.querySelector('#load-notice').innerText.trim() === text", arg=at_16_bits, timeout=10_000)
    page.get_by_role("radio", name="auto", exact=True).check()
    page.wait_for_function("text => document.querySelector('#load-notice').innerText.trim() === text", arg=warning, timeout=10_000)
    page.locator("#model-box textarea").press_sequentially("x")
    page.wait_for_function("document.querySelector('#catalog-entry input').value === ''", timeout=10_000)


# A reply as models write them: every markdown construct that colouring could break.
MARKDOWN_REPLY = """# Checking primes

Here is a **simple** function with `n < 2` handled first:

```python
def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, int(n ** 0.5) + 1))
```

How it works:

1. Numbers below 2 are *not* prime.
2. For the rest:
   - try each divisor up to the square root;
   - stop at the first one that divides `n`.

| n | prime? |
|---|:------:|
| 7 | yes |
| 9 | no \\| 3 x 3 |

> Tip: a <div> or <script>alert(1)</script> in the text stays text, & so does &amp;.

See [the docs](https://docs.python.org/3/) for `range`. Done!
"""


def token_segments(text: str, seed: int = 3) -> list[list[str]]:
    """The text cut into token-sized pieces (1-6 characters), origins alternating at random."""
    import random

    rng = random.Random(seed)
    segments, position = [], 0
    while position < len(text):
        size = rng.randint(1, 6)
        segments.append([text[position : position + size], "draft" if rng.random() < 0.6 else "base"])
        position += size
    return segments


def rendered(page) -> dict:
    bubble = page.locator("#chatbot .message-row.bot-row, #chatbot [data-testid='bot']").last
    return {
        "text": bubble.inner_text(),
        "structure": bubble.evaluate(
            "b => ['pre code', 'h1', 'ol > li', 'ul > li', 'table td', 'blockquote', 'a', 'strong', 'em', 'p > code', 'td > code']"
            ".map(s => s + ':' + b.querySelectorAll(s).length).join(' ')"
        ),
        "highlights": bubble.locator("span.kd").count(),
    }


def shown_at_next_load(page, chat_id: str) -> None:
    """The page's next load shows this chat, as a reload shows the chat the tab
    showed: not by the settings' open chat, which a write of the previous
    test's still running may replace meanwhile. The page records the chat it
    shows there itself once its load has set it (render.KEEP_SHOWN_JS), which
    may come after the settings the page fixture waits for: that record is
    waited for first, else it could write over this one before the reload."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    try:
        page.wait_for_function("sessionStorage.getItem('kestrel-shown-chat') !== null", timeout=10_000)
    except PlaywrightTimeoutError:  # a page that shows no saved chat records none
        pass
    page.evaluate("id => sessionStorage.setItem('kestrel-shown-chat', id)", chat_id)


def saved_and_open(data_dir, chat) -> None:
    """Save a chat as if it had been written in, so that the next page load (of a new tab) shows it."""
    from app.store import Store

    store = Store(data_dir)
    store.save_chat(chat)
    store.save_settings({**store.load_settings(), "open_chat": chat["id"]})


def test_a_reload_shows_the_chat_this_tab_showed(browser, app_url, data_dir):
    """Two tabs on two chats: a reload of one shows its own chat again, not
    the one the other tab opened last (which a new tab shows)."""
    from app.store import Store, new_chat

    chats = {}
    for name in ("Tab one's chat", "Tab two's chat"):
        chats[name] = new_chat()
        chats[name]["messages"] = [{"role": "user", "content": name}, {"role": "assistant", "content": f"Yes: {name}."}]
        Store(data_dir).save_chat(chats[name])
        time.sleep(0.01)
    saved_and_open(data_dir, chats["Tab two's chat"])
    tabs = [browser.new_page(viewport={"width": 1400, "height": 1000}) for _ in range(3)]

    def shows(tab, name: str) -> None:
        tab.wait_for_function(f"document.querySelector('#chatbot').innerText.includes({json.dumps('Yes: ' + name)})", timeout=15_000)

    def opens(tab, name: str) -> None:
        tab.goto(app_url)
        tab.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        tab.get_by_text("Saved chats").click()
        tab.locator("#chats input").click()
        tab.get_by_role("option", name=name).first.click()
        shows(tab, name)
        tab.wait_for_function(f"document.querySelector('#shown-chat-id textarea').value === {json.dumps(chats[name]['id'])}")

    try:
        opens(tabs[0], "Tab one's chat")
        opens(tabs[1], "Tab two's chat")  # opened last
        tabs[0].wait_for_timeout(500)
        tabs[0].reload()
        tabs[0].locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        shows(tabs[0], "Tab one's chat")
        tabs[2].goto(app_url)  # a new tab: the chat opened last
        tabs[2].locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        shows(tabs[2], "Tab two's chat")
    finally:
        for tab in tabs:
            tab.close()


def test_coloured_replies_render_like_uncoloured_ones(browser, data_dir, app_url):
    from app.store import new_chat

    chat = new_chat()
    chat["messages"] = [
        {"role": "user", "content": "Write a prime check and explain it."},
        {"role": "assistant", "content": MARKDOWN_REPLY, "segments": token_segments(MARKDOWN_REPLY)},
    ]
    saved_and_open(data_dir, chat)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})  # a tab of its own, opened on the chat (as the copying test's)
    page.add_init_script(f"sessionStorage.setItem('kestrel-shown-chat', {json.dumps(chat['id'])})")  # as shown_at_next_load
    try:
        page.goto(app_url)
        page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        page.locator("#chatbot").get_by_text("Checking primes").wait_for(timeout=60_000)
        coloured_and_plain(page)
    finally:
        page.close()


def coloured_and_plain(page) -> None:
    """The chat shown, coloured and uncoloured: the same text and structure."""
    if not page.locator("#colour input").is_checked():
        page.locator("#colour input").check()
        page.wait_for_function("document.querySelectorAll('#chatbot span.kd').length > 0")
    coloured = rendered(page)
    screenshot(page, "colour-on")
    page.locator("#colour input").uncheck()
    page.wait_for_function("document.querySelectorAll('#chatbot span.kd').length == 0")
    plain = rendered(page)
    screenshot(page, "colour-off")
    assert coloured["highlights"] > 20 and plain["highlights"] == 0
    assert coloured["text"] == plain["text"]
    assert coloured["structure"] == plain["structure"]
    for kind, count in (("pre code", 1), ("h1", 1), ("ol > li", 2), ("ul > li", 2), ("table td", 4), ("blockquote", 1), ("a", 1)):
        assert f"{kind}:{count}" in plain["structure"], plain["structure"]
    for visible in ("<span", "&lt;", "&amp;amp;", "style="):
        assert visible not in coloured["text"]
    assert "<script>alert(1)</script>" in coloured["text"] and "<div>" in coloured["text"]
    assert page.evaluate("typeof window.alert") == "function"


LEAKS = (
    "a \\`<img src=http://leak.invalid/1.png>` after",  # an escaped backtick opens no span
    "indented:\n\n    ```\n<img src=http://leak.invalid/2.png>\n    ```",  # indented code, ended by the next line
    "- item\n  ```\n<form action=http://leak.invalid/><button>go</button></form>\n  ```",  # the list item ends
    "one `two\nthree` <img src=http://leak.invalid/3.png> `four`",  # markdown pairs backticks across lines
    "| `<img src=http://leak.invalid/4.png>|` |\n|---|---|",  # a table splits a span at its pipe
    # a line that starts like a fence's end but does not end it for markdown: the fences after it pair otherwise
    "````\n```\n````\n<img src=http://leak.invalid/6.png>\n```",  # shorter than the opening run
    "```\nx\n    ```\n```\n<img src=http://leak.invalid/7.png>\n```",  # indented 4 spaces
    "```\nx\n```py\n```\n<a href=http://leak.invalid/8>a link</a>\n```",  # with an info string
    "~~~~\n~~~\n~~~~\n<img src=http://leak.invalid/9.png>\n~~~",  # tildes
    "- ```\n  x\n  ```\n  <img src=http://leak.invalid/10.png>\n  ```",  # a fence opened after a list marker
    # where Gradio's chatbot or marked read a fence otherwise
    "```mermaid\ngraph TD\n  A[<img src=http://leak.invalid/11.png>] --> B\n```",  # put into the page unescaped
    "~~~\n```mermaid\n<img src=http://leak.invalid/12.png>\n```\n~~~",  # the same, inside a tilde fence
    "Text\n```<img src=http://leak.invalid/13.png>",  # an unclosed fence on the last line: text
    "$$\n```\n$$\n<img src=http://leak.invalid/14.png>\n```",  # $$ pairs are taken out first
    "[x]:\n```\n<img src=http://leak.invalid/15.png>\n```",  # a link definition's target
    "```\nx\r```\r<img src=http://leak.invalid/16.png>\n```",  # a lone \r breaks a line
)


def test_text_that_markdown_may_not_read_as_code_shows_as_text(page, data_dir):
    """No tag that a message spells out is made, wherever markdown ends a code
    span or block: no image is fetched, no form made."""
    from app.store import new_chat

    chat = new_chat()
    chat["messages"] = [
        message for text in LEAKS
        for message in ({"role": "user", "content": text}, {"role": "assistant", "content": text, "segments": token_segments(text)})
    ]  # fmt: skip
    saved_and_open(data_dir, chat)
    requested = []
    page.on("request", lambda request: requested.append(request.url) if "leak.invalid" in request.url else None)
    shown_at_next_load(page, chat["id"])
    page.reload()
    page.locator("#chatbot").get_by_text("four").first.wait_for(timeout=30_000)
    for colour in (True, False):
        if page.locator("#colour input").is_checked() != colour:
            page.locator("#colour input").set_checked(colour)
            page.wait_for_function(f"(document.querySelectorAll('#chatbot span.kd').length > 0) === {str(colour).lower()}")
        assert page.locator("#chatbot img, #chatbot form, #chatbot a:has-text('a link'), #chatbot button:has-text('go')").count() == 0, colour
        assert page.locator("#chatbot").get_by_text("<img src=http://leak.invalid/1.png>", exact=False).count() == 2, colour
    assert requested == []
    # and should a tag ever be made, the page's policy blocks an image from another host before it is fetched
    blocked = []
    page.on("requestfailed", lambda request: blocked.append((request.url, request.failure)) if "leak.invalid" in request.url else None)
    page.evaluate("""() => {
        const image = document.createElement('img');
        image.src = 'http://leak.invalid/5.png';
        document.querySelector('#chatbot').appendChild(image);
    }""")
    page.wait_for_function("() => document.querySelector('#chatbot img').complete")
    page.wait_for_timeout(200)
    assert requested == ["http://leak.invalid/5.png"] and blocked == [("http://leak.invalid/5.png", "csp")]


def test_bench_app_waits_in_the_page_for_the_count_or_for_quiet(browser):
    from app.appbench import settled

    page = browser.new_page()
    try:
        # the count reaches the expected one after a while: settled waits for it
        page.set_content('<span id="stat-tokens">0</span>')
        page.evaluate("setTimeout(() => { document.querySelector('#stat-tokens').innerText = '7'; }, 600)")
        start = time.monotonic()
        settled(page, 7, quiet=30, timeout=20)
        assert 0.5 < time.monotonic() - start < 10
        # a reply that stops short: the count stops changing, settled returns after `quiet`
        page.set_content('<span id="stat-tokens">3</span>')
        page.evaluate("() => { delete window.__kestrelSettled; }")
        start = time.monotonic()
        settled(page, 9, quiet=1.0, timeout=20)
        assert 1.0 < time.monotonic() - start < 10
        # no count at all: a timeout names what did not happen
        page.set_content("<p>no reply</p>")
        with pytest.raises(KestrelError, match="did not finish"):  # one error line from the command, not a traceback
            settled(page, 9, quiet=1.0, timeout=2)
    finally:
        page.close()


def test_bench_app_s_browser_run_reads_its_own_reply_not_the_chat_the_page_opened_with(page, app_url, data_dir):
    """The page opens with the last chat written, whose panel can show the very
    count the run expects: the run reads its own reply's figures, after New chat."""
    from app.appbench import through_browser

    settings(page, 4)
    send(page, "w1 w2")
    page.get_by_text(re.compile("The reply reached the token limit")).wait_for(timeout=60_000)
    page.wait_for_timeout(500)  # the chat saved as the one a page opens with
    results = []  # its own Playwright, on a thread of its own (this one runs the test's)
    # in eagle2, the mode the other tests' pages start with: the run's choice is saved as the page's setting
    run = threading.Thread(target=lambda: results.append(through_browser(app_url, "w5 w6 w7", "eagle2", 4, expected_tokens=4)))
    run.start()
    run.join(180)
    assert results and results[0]["tokens"] == 4 and results[0]["tokens_per_s"] > 0
    replies = [chat for chat in saved_chats(data_dir, 0) if chat["messages"][0]["content"] == "w5 w6 w7"]
    assert replies and replies[-1]["messages"][-1]["stats"]["tokens"] == 4


def test_copying_a_message_gives_its_text_as_written(browser, app_url, data_dir):
    """The copy buttons copy what the model wrote, not the page's markup
    (escaped prose, highlight spans), with colouring on or off."""
    from app.store import new_chat

    chat = new_chat()
    code = '<p>a &#60; b &#38; c</p>\n<span class="kd" style="x">hi</span>'
    reply = (f"{MARKDOWN_REPLY}\nIn HTML write `&#60;` for <, as here:\n\n```html\n{code}\n```\n"
             "In C++, type ``` only to fence:\n```cpp\nint a = b < c;\n```\n"
             "Spans as written: ``a<b`` and ` <a> `.\n\n    ```\n<b>not a fence</b>\n    ``` ~~~\n"
             "Docs at <https://example.com/a?b=1&c=2>, or https://example.com/x&.\nMail help.desk@example.com today.\nThe end.\n")  # fmt: skip
    chat["messages"] = [
        {"role": "user", "content": "Don't <b>bold</b> & \"quote\" it; type &lt; or &#60; for <."},
        {"role": "assistant", "content": reply, "segments": token_segments(reply)},
    ]
    saved_and_open(data_dir, chat)
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, permissions=["clipboard-read", "clipboard-write"])
    page.add_init_script(f"sessionStorage.setItem('kestrel-shown-chat', {json.dumps(chat['id'])})")  # as shown_at_next_load
    try:
        page.goto(app_url)
        page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        page.locator("#chatbot").get_by_text("Checking primes").wait_for(timeout=30_000)
        # bare and bracketed addresses link to themselves, with the text around them shown as written
        page.locator("#chatbot").get_by_text("Docs at <https://example.com/a?b=1&c=2>, or https://example.com/x&.").wait_for(timeout=5_000)
        page.locator("#chatbot").get_by_text("type &lt; or &#60; for <.").wait_for(timeout=5_000)
        for colour in (True, False):
            if page.locator("#colour input").is_checked() != colour:
                page.locator("#colour input").set_checked(colour)
                page.wait_for_function(f"(document.querySelectorAll('#chatbot span.kd').length > 0) === {str(colour).lower()}")
            links = page.evaluate("[...document.querySelectorAll('#chatbot .message-content a')].map(a => a.getAttribute('href'))")
            assert [link for link in links if "example" in link] == [
                "https://example.com/a?b=1&c=2", "https://example.com/x", "mailto:help.desk@example.com"], colour
            # each message's accessible name is its text as shown, not its markup
            labels = page.evaluate("[...document.querySelectorAll('#chatbot [aria-label*=\"s message: \"]')].map(e => e.getAttribute('aria-label'))")
            assert len(labels) == 2, labels
            assert labels[0] == "user's message: Don't <b>bold</b> & \"quote\" it; type &lt; or &#60; for <.", labels[0]
            assert labels[1].startswith("bot's message: Checking primes Here is a simple function") and "background:rgba" not in labels[1], labels[1][:200]
            assert labels[1].endswith("Docs at <https://example.com/a?b=1&c=2>, or https://example.com/x&. Mail help.desk@example.com today. The end."), labels[1][-200:]
            page.wait_for_function("document.querySelectorAll(\"#chatbot button[aria-label='Copy message']\").length == 2")
            copied = []
            for button in [*page.locator("#chatbot button[aria-label='Copy message']").all(), page.locator("#chatbot button[aria-label='Copy conversation']")]:
                page.evaluate("navigator.clipboard.writeText('')")
                button.click()
                page.wait_for_function("navigator.clipboard.readText().then(text => text.length > 0)")
                copied.append(page.evaluate("navigator.clipboard.readText()"))
            assert copied[:2] == [chat["messages"][0]["content"], reply.strip()], colour  # Gradio trims a message
            assert chat["messages"][0]["content"] in copied[2] and reply.strip() in copied[2], colour
            page.evaluate("navigator.clipboard.writeText('')")
            assert page.locator("#chatbot pre").get_by_text("int a = b < c;").count() == 1  # a cpp fence renders
            page.locator("#chatbot .copy_code_button").nth(1).click()  # the html block's own button: its code, raw
            page.wait_for_function("navigator.clipboard.readText().then(text => text.length > 0)")
            assert page.evaluate("navigator.clipboard.readText()").strip() == code, colour
        page.evaluate("navigator.clipboard.writeText('a &#60;b&#62;')")  # elsewhere on the page, text is left alone
        assert page.evaluate("navigator.clipboard.readText()") == "a &#60;b&#62;"
    finally:
        page.close()


def test_a_reasoning_model_s_reasoning_is_folded_and_copied_as_written(browser, app_url, data_dir):
    """Qwen3's and DeepSeek-R1's replies begin with their reasoning: it showed
    as text with literal <think> tags above the answer, thousands of tokens of
    it. It folds under "Reasoning" (open while still thinking), and copying
    gives the reply as written, tags included."""
    from app.render import message_html
    from app.store import new_chat

    chat = new_chat()
    qwen3 = "<think>\nThe user asks for 2+2. **Two** and two: `a < b`.\n</think>\n\nIt is **4**."
    r1 = "They ask again; three and three.\n</think>\n\nIt is 6."  # the template opened the reasoning
    thinking = "<think>\nStill weighing it"
    fenced = "<think>\nTry it:\n```python\nprint(4 + 4)\n</think>\n\nIt is 8."  # a code block the reasoning leaves open
    chat["messages"] = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": qwen3, "segments": token_segments(qwen3), "reasoning": True},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": r1, "segments": token_segments(r1), "reasoning": True},
        {"role": "user", "content": "And 4+4?"},
        {"role": "assistant", "content": thinking, "segments": token_segments(thinking), "reasoning": True},
        {"role": "user", "content": "Tags?"}, {"role": "assistant", "content": "Close it with </think> then."},  # another model's: as written
        {"role": "user", "content": "Again?"}, {"role": "assistant", "content": fenced, "segments": token_segments(fenced), "reasoning": True},
    ]
    saved_and_open(data_dir, chat)
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, permissions=["clipboard-read", "clipboard-write"])
    page.add_init_script(f"sessionStorage.setItem('kestrel-shown-chat', {json.dumps(chat['id'])})")
    try:
        page.goto(app_url)
        page.locator("#mode input[value=eagle2]:checked").wait_for(timeout=30_000)
        blocks = page.locator("#chatbot details.kestrel-think")
        blocks.nth(2).wait_for(timeout=30_000)
        page.locator("#chatbot").get_by_text("Close it with </think> then.").wait_for(timeout=5_000)
        assert blocks.count() == 4 and page.locator("#chatbot").get_by_text("<think>").count() == 0
        assert [block.locator("summary").inner_text() for block in blocks.all()] == ["Reasoning", "Reasoning", "Reasoning...", "Reasoning"]
        assert page.evaluate("[...document.querySelectorAll('#chatbot details.kestrel-think')].map(d => d.open)") == [False, False, True, False]
        for answer in ("It is 4.", "It is 6.", "It is 8."):
            assert page.locator("#chatbot").get_by_text(answer).is_visible(), answer
        reasoning = page.locator("#chatbot").get_by_text("three and three.")
        assert not reasoning.is_visible()
        blocks.nth(1).locator("summary").click()
        reasoning.wait_for(state="visible", timeout=5_000)
        page.evaluate("navigator.clipboard.writeText('')")
        page.locator("#chatbot button[aria-label='Copy message']").nth(1).click()  # the first reply's own button
        page.wait_for_function("navigator.clipboard.readText().then(text => text.length > 0)")
        assert page.evaluate("navigator.clipboard.readText()") == qwen3
        # each reply's content as the chat hands it to the clipboard (the markup above), copied from the chat
        copy = """(text) => {
          document.querySelector('#chatbot').dispatchEvent(new MouseEvent('click', {bubbles: true}));
          return navigator.clipboard.writeText(text).then(() => navigator.clipboard.readText());
        }"""
        for message in chat["messages"][1::2]:
            assert page.evaluate(copy, message_html(message, True)) == message["content"], message["content"]
    finally:
        page.close()


def test_charts_keep_their_data_when_a_reply_is_refused(page):
    """A message refused for the context window after a new chat: the run had
    sent the empty charts, then skipped them in its last update, which Gradio
    streams as a diff deleting the charts' data in the page. The charts stay
    drawn and resizing the window raises no errors in the page."""
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.locator("#new-chat").click()
    send(page, "w1 " * 3000)
    page.locator("#notice").get_by_text("context window").wait_for(timeout=30_000)
    for width, height in ((900, 700), (1400, 1000)):
        page.set_viewport_size({"width": width, "height": height})
        time.sleep(1)
    assert errors == []
    for chart in ("#depth-plot", "#rate-plot"):
        assert page.locator(f"{chart} svg [aria-label^='Y-axis']").count() >= 1, chart
