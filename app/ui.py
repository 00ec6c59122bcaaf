"""The browser UI: layout and event wiring. Handlers live in app/chat.py,
app/compare.py and app/library.py; everything that runs the model shares one
concurrency group, so requests queue instead of running at once."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import gradio as gr

from app import render
from app.chat import MODE_LABELS, RANGES, ChatHandlers, default_settings, mode_choices
from app.compare import SUMMARY_COLUMNS, CompareHandlers
from app.instance import DataLock, data_dir, open_browser, tell_running
from app.library import (
    DTYPE_CHOICES, MODEL_SETTING, TRAINED_LABEL, LibraryHandlers, catalog_frame, cpu_weight_bytes, detected_memory, error_text,
    recommended_sampling, remembered_model,
)  # fmt: skip
from app.runtime import Runtime
from app.server import HOST_NAME, LOCALHOST, Access, Server, allowable_origin, new_api_key, web_origin
from app.store import Store
from core.config import MODES, TreeParams
from core.engine import Engine
from models import catalog
from models.base import QUANTIZATIONS, resolve_device
from models.errors import KestrelError

log = logging.getLogger(__name__)

MODEL = {"concurrency_limit": 1, "concurrency_id": "model"}  # every event that runs the model
# Streams that show their own progress (text, statistics, a notice): Gradio's
# overlay and timer would animate every frame in the browser, and on a small
# machine the browser's work is taken from the decoding.
STREAM = {**MODEL, "show_progress": "hidden"}


def as_typed(control: gr.components.Component) -> None:
    """The control's value reaches the handlers as typed (an emptied box is
    None): Gradio's own check would round it, or refuse it in a message that
    names neither the setting nor keeps the message being sent, where
    Options.from_values names the setting and gives the message back."""
    control.preprocess = lambda payload: payload


CHATBOT_HEIGHT = "clamp(200px, calc(100vh - 350px), 760px)"


def build_app(runtime: Runtime, store_dir: Path, device: str = "auto", compile: str = "auto") -> gr.Blocks:
    store = Store(Path(store_dir))
    chat = ChatHandlers(runtime, store)
    compare = CompareHandlers(runtime)
    library = LibraryHandlers(  # as `ui` loaded the first model; the one loaded in the tab is the next start's
        runtime, Path(store_dir) / "heads", device, compile, remember=lambda choice: store.update_settings({MODEL_SETTING: choice})
    )
    defaults, tree = default_settings(), TreeParams()

    # Gradio's copies of exported files: those a day old go daily, all of them when the app restarts
    with gr.Blocks(title="Kestrel", analytics_enabled=False, delete_cache=(86400, 86400)) as demo:
        chat_state = gr.State(None)
        with gr.Tabs():
            with gr.Tab("Chat", id="chat") as chat_tab:
                with gr.Row():
                    with gr.Column(scale=3):
                        system = gr.Textbox(label="System prompt", lines=1, elem_id="system")
                        chatbot = gr.Chatbot(
                            # as tall as the window leaves room for: the message box, Send and the buttons below stay in view
                            elem_id="chatbot", height=CHATBOT_HEIGHT, sanitize_html=True, show_label=False,
                            feedback_options=None, buttons=["copy", "copy_all"],
                        )  # fmt: skip
                        notice = gr.HTML(elem_id="notice")
                        with gr.Row():
                            message = gr.Textbox(placeholder="Message (Enter to send)", label="Message", show_label=False, scale=5, elem_id="message")
                            send = gr.Button("Send", variant="primary", scale=1, min_width=70, elem_id="send")
                            stop = gr.Button("Stop", variant="stop", scale=1, min_width=70, elem_id="stop")
                        with gr.Row():
                            regenerate = gr.Button("Regenerate", size="sm", min_width=80, elem_id="regenerate")
                            earlier = gr.Button("Earlier reply", size="sm", min_width=80, elem_id="earlier-reply")
                            edit = gr.Button("Edit last message", size="sm", min_width=80, elem_id="edit")
                            clear = gr.Button("Clear", size="sm", min_width=80, elem_id="clear")
                            new = gr.Button("New chat", size="sm", min_width=80, elem_id="new-chat")
                        with gr.Accordion("Saved chats", open=False):
                            # allow_custom_value: a page whose state the server let go (a restart, PAGE_SESSIONS_KEPT) still opens
                            # the chats it lists, which Gradio checks against the choices that state held; `open` checks the id
                            chats = gr.Dropdown(label="Open a saved chat", choices=[], elem_id="chats", allow_custom_value=True)
                            with gr.Row(equal_height=True):
                                chat_name = gr.Textbox(label="Name of this chat", placeholder="its first message", max_lines=1,
                                                       show_label=False, scale=4, elem_id="chat-name")  # fmt: skip
                                rename = gr.Button("Rename", size="sm", scale=1, min_width=80, elem_id="rename")
                            with gr.Row():
                                export = gr.Button("Export (Markdown + JSON)", size="sm", elem_id="export")
                                importer = gr.UploadButton("Import (JSON)", file_types=[".json"], size="sm", elem_id="import")
                                delete = gr.Button("Delete this chat", size="sm", variant="stop", elem_id="delete")
                            exported = gr.File(label="Exported files", file_count="multiple", interactive=False, elem_id="exported")
                    with gr.Column(scale=2):
                        stats = gr.HTML(render.stats_html(None, 0, None), elem_id="stats")
                        depth_plot = gr.BarPlot(
                            render.depth_frame(None), x="depth", y="acceptance", y_lim=[0, 1], sort=render.DEPTH_ORDER,
                            title="Acceptance per draft depth", height=170, elem_id="depth-plot",
                        )  # fmt: skip
                        rate_plot = gr.LinePlot(
                            render.rate_frame([]), x="seconds", y="tokens/s", title="Tokens/s over the reply", height=170,
                            x_axis_format="~g", y_axis_format=".0f", elem_id="rate-plot",
                        )  # fmt: skip
                        calibration_plot = gr.LinePlot(
                            render.calibration_frame([]), x="draft confidence", y="accepted", color="series",
                            x_lim=[0, 1], y_lim=[0, 1], title="Accepted, by draft confidence",
                            height=200, elem_id="calibration-plot",
                        )  # fmt: skip
                        with gr.Accordion("Decoding settings", open=True):
                            # every mode here; the page load narrows the choices to the loaded model's
                            mode = gr.Radio(mode_choices(MODES), value="vanilla", label="Mode",
                                            info="EAGLE modes appear when a draft head is loaded", elem_id="mode")  # fmt: skip
                            colour = gr.Checkbox(defaults["colour"], label="Colour tokens by origin", elem_id="colour")
                            gr.HTML(render.LEGEND)
                            temperature = gr.Slider(*RANGES["temperature"], defaults["temperature"], step=0.05, label="Temperature (0 = greedy)")
                            top_p = gr.Slider(*RANGES["top_p"], defaults["top_p"], step=0.05, label="Top-p")
                            top_k = gr.Number(defaults["top_k"], label="Top-k (0 = off)")
                            max_new_tokens = gr.Slider(*RANGES["max_new_tokens"], defaults["max_new_tokens"], step=1, label="Max new tokens")
                            seed = gr.Number(defaults["seed"], label="Seed (-1 = random)")
                            total_tokens = gr.Slider(*RANGES["total_tokens"], tree.total_tokens, step=1, label="Tree: tokens verified per step",
                                                     info="the three Tree settings are EAGLE-2's (EAGLE drafts a fixed tree); "
                                                          "0 = sized every step from this device's measured costs; "
                                                          "else the head's drafted tokens, and text copied from the chat comes on top")  # fmt: skip
                            depth = gr.Slider(*RANGES["depth"], tree.depth, step=1, label="Tree: depth (the most the head drafts, when sized automatically; text copied from the chat may go deeper)")
                            tree_top_k = gr.Slider(*RANGES["tree_top_k"], tree.top_k, step=1, label="Tree: top-k per node")
                            for box in (temperature, top_p, top_k, max_new_tokens, seed, total_tokens, depth, tree_top_k):
                                as_typed(box)
            controls = [mode, temperature, top_p, top_k, max_new_tokens, seed, total_tokens, depth, tree_top_k, colour]

            with gr.Tab("Compare", id="compare"):
                gr.Markdown("One prompt through vanilla decoding, then EAGLE-2, one after the other, "
                            "with the decoding settings of the Chat tab.")  # fmt: skip
                with gr.Row():
                    prompt = gr.Textbox(placeholder="Prompt to compare (Enter to run)", label="Prompt to compare", show_label=False, scale=5,
                                        elem_id="compare-prompt")  # fmt: skip
                    run_compare = gr.Button("Compare", variant="primary", scale=1, elem_id="compare-run")
                    stop_compare = gr.Button("Stop", variant="stop", scale=1, elem_id="compare-stop")
                with_eagle = gr.Checkbox(False, label="Also run EAGLE (static tree)")
                gr.HTML(render.LEGEND)
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("**Vanilla**")
                        pane_vanilla = gr.HTML(elem_id="pane-vanilla")
                    with gr.Column(visible=False) as eagle_column:
                        gr.Markdown("**EAGLE**")
                        pane_eagle = gr.HTML(elem_id="pane-eagle")
                    with gr.Column():
                        gr.Markdown("**EAGLE-2**")
                        pane_eagle2 = gr.HTML(elem_id="pane-eagle2")
                verdict = gr.HTML(elem_id="verdict-box")
                with gr.Accordion("Benchmark", open=False):
                    gr.Markdown("Runs a few built-in prompts (or your JSONL file: one `{\"turns\": [prompt]}` per line) "
                                "through vanilla and EAGLE-2 with the Chat tab's settings.")  # fmt: skip
                    with gr.Row():
                        upload = gr.File(label="Prompts (.jsonl, optional)", file_types=[".jsonl"], type="filepath")
                        limit = gr.Slider(1, 80, 4, step=1, label="Prompts to run", elem_id="bench-limit")
                    run_bench = gr.Button("Run benchmark", elem_id="bench-run")
                    bench_notice = gr.HTML(elem_id="bench-notice")
                    bench_table = gr.Dataframe(headers=list(SUMMARY_COLUMNS), label="Summary",
                                               interactive=False, elem_id="bench-table")  # fmt: skip
                    bench_chart = gr.BarPlot(x="mode", y="tokens/s", y_lim=[0, None], sort=[MODE_LABELS[m] for m in MODES], title="Tokens/s",
                                             height=200, elem_id="bench-chart")  # as the table: vanilla first
                    bench_json = gr.JSON(label="Full result", open=False)

            with gr.Tab("Models", id="models") as models_tab:
                placed = resolve_device(device)  # where models load (`ui --device`)
                memory_gb, memory_kind = detected_memory(placed)
                load_bytes = cpu_weight_bytes(placed)
                peak = (f" On this CPU a model loads whole in {'bfloat16' if load_bytes == 2 else 'float32'} before its "
                        "weights are quantized: 'here' counts that peak too." if load_bytes else "")  # fmt: skip
                status = gr.HTML(elem_id="model-status")
                gr.Markdown(
                    f"Detected memory: **{memory_gb:.1f} GB** of {memory_kind}; each size says whether it fits here. "
                    f"'4-bit on a {catalog.CONSUMER_GPU_NAME} GPU' says whether the 4-bit model fits one "
                    "(an RTX 3060). Estimates include the draft head and about 1 GB of runtime overhead; "
                    f"4/8-bit need bitsandbytes (CUDA for speed).{peak}"
                    if memory_gb else f"Detected memory: {memory_kind}."
                )  # fmt: skip
                gr.Dataframe(catalog_frame(memory_gb, load_bytes), interactive=False, label="Catalog")
                entry = gr.Dropdown([e.name for e in catalog.CATALOG], label="Catalog entry", value=None, elem_id="catalog-entry")
                with gr.Row():
                    model_box = gr.Textbox(label="Base model (repo id as owner/name, or owner/name@REV to pin a revision; local folder or .gguf file; empty = bundled default)", elem_id="model-box")
                    head_box = gr.Textbox(label="Draft head (repo id, owner/name@REV too, or local folder; empty = bundled, if any)")
                trained = gr.Dropdown(
                    [], label=f"{TRAINED_LABEL} (overrides the head box)",
                    info=library.heads_info, allow_custom_value=True,  # a page whose state the server let go still loads what it lists
                )  # fmt: skip
                with gr.Row():
                    quantization = gr.Radio(list(QUANTIZATIONS), value="auto", label="Quantization", info="int4/int8: CPU kernels (int4: Kestrel's own where a C++ compiler is found); 8bit/4bit: bitsandbytes, for GPUs (slow on CPUs); auto: on CPUs int4 for a Q4_1 GGUF where Kestrel's kernel is built, else int8 where it is faster; on GPUs 4bit where 16 bits would not fit")
                    dtype = gr.Dropdown(list(DTYPE_CHOICES), value="auto", label="Compute dtype", info="float64: slow; for checking that EAGLE-2 replies equal vanilla's bit for bit")
                with gr.Row():
                    load = gr.Button("Load", variant="primary")
                    unload = gr.Button("Unload (free memory)")
                load_notice = gr.HTML(elem_id="load-notice")

        # a message that goes back to the box (stopped before its reply started, refused): by way of a hidden
        # box, which `give_back` joins to what was typed meanwhile, so neither is lost
        returned = gr.Textbox(visible=False)
        give_back = {"fn": None, "inputs": [returned, message], "outputs": [message, returned], "js": render.GIVE_BACK_JS,
                     "show_progress": "hidden", "api_name": False}  # fmt: skip
        chat_outputs = [returned, chatbot, chat_state, notice, stats, depth_plot, rate_plot, calibration_plot]
        refresh = {"fn": chat.listed, "inputs": chat_state, "outputs": chats, "show_progress": "hidden"}
        # the sent message, on its way from accept to send: a hidden box rather than a State, so
        # that the page's /send endpoint (gradio_client) still takes the message as its first input
        pending = gr.Textbox(visible=False)
        # the id of the chat shown, kept by the page itself: a server restarted since the page opened has lost
        # chat_state (kept by the server), and Send then continues the saved chat this names instead of a new one
        shown_id = gr.Textbox(visible="hidden", elem_id="shown-chat-id")
        # what Edit took back from that chat, kept by the page too: Send after such a restart sends the edited message in its place
        taken = gr.Textbox(visible="hidden", elem_id="taken-back")
        # set after each change of the chat shown (a State's .change listener would hash the whole chat at every streamed frame)
        remember = {"fn": chat.shown_marks, "inputs": chat_state, "outputs": [shown_id, taken], "show_progress": "hidden", "api_name": False,
                    "concurrency_limit": None}  # fmt: skip
        # before the buttons that act on the chat shown: after such a restart, the saved chat that shown_id names
        recover = {"fn": chat.recover, "inputs": [chat_state, shown_id, taken], "outputs": chat_state, "show_progress": "hidden",
                   "api_name": False, "concurrency_limit": None}  # fmt: skip
        for trigger, api_name in ((send.click, "send"), (message.submit, False)):
            # accept at once (the message leaves the box and is saved; Stop applies from here), then wait for the model
            trigger(
                chat.accept, [message, chat_state, colour, shown_id, taken], [message, pending, chatbot, chat_state, notice],
                concurrency_limit=None, show_progress="hidden", api_name=False, trigger_mode="multiple",  # a Send during a reply is refused, not dropped
            ).success(chat.send, [pending, chat_state, system, *controls], chat_outputs, api_name=api_name, **STREAM).then(**give_back).then(**refresh).then(**remember)  # fmt: skip
        refused = gr.Checkbox(False, visible=False)  # Regenerate pressed while this chat's reply is written: check_idle says so at once
        regenerate.click(**recover).then(chat.check_idle, chat_state, [notice, refused], concurrency_limit=None, show_progress="hidden", api_name=False).then(
            chat.regenerate, [chat_state, refused, system, *controls], chat_outputs, **STREAM
        ).then(**give_back).then(**refresh)
        stop.click(**recover).then(chat.stop, chat_state, notice, concurrency_limit=None, show_progress="hidden")
        demo.unload(chat.forget_session)  # a closed tab's waiting Send or Regenerate no longer holds its chat
        demo.unload(compare.forget)  # ... nor its comparison or benchmark the model
        saved_plots = {"fn": chat.plots_of, "inputs": chat_state, "outputs": [depth_plot, rate_plot, calibration_plot],
                       "show_progress": "hidden", "api_name": False}  # fmt: skip
        earlier.click(**recover).then(chat.earlier_reply, [chat_state, colour], [chatbot, chat_state, stats, notice], show_progress="hidden").then(
            **refresh
        ).then(**saved_plots)
        edit.click(**recover).then(chat.edit_last, [chat_state, colour, message], [message, chatbot, chat_state, notice], show_progress="hidden").then(
            None, [message, notice], None, js=render.edited_js("message"), api_name=False
        ).then(**refresh).then(**remember)
        # Clear and Delete remove the saved chat: the browser's dialog asks first (a hidden box carries the answer)
        confirmed = gr.Checkbox(False, visible=False)
        ask = "() => confirm('{}')".format
        ask_clear = ask("Clear this chat? Its messages are deleted from the saved chats.")
        clear.click(None, None, confirmed, js=ask_clear, api_name=False).then(**recover).then(
            chat.clear, [chat_state, confirmed], [chatbot, chat_state, stats, depth_plot, rate_plot, notice], show_progress="hidden"
        ).then(**refresh).then(**remember)
        # the chatbot's own trash icon empties the view at once: the same question, and the chat shown again if refused
        chatbot.clear(None, None, confirmed, js=ask_clear, api_name=False).then(**recover).then(
            chat.clear, [chat_state, confirmed, colour], [chatbot, chat_state, stats, depth_plot, rate_plot, notice], show_progress="hidden"
        ).then(**refresh).then(**remember)
        # the exported files stay listed only while their chat is shown
        exports_shown = {"fn": chat.exports_of, "inputs": [exported, chat_state], "outputs": exported, "show_progress": "hidden"}
        new.click(chat.new, [chat_state, system], [chatbot, chat_state, stats, depth_plot, rate_plot, chats, notice], show_progress="hidden").then(
            **exports_shown
        ).then(**remember)
        chats.input(
            chat.open, [chats, chat_state, colour], [chatbot, chat_state, system, stats, depth_plot, rate_plot, chats, notice], show_progress="hidden"
        ).then(**exports_shown).then(**remember).then(chat.name_of, chat_state, chat_name, show_progress="hidden", api_name=False)
        delete.click(None, None, confirmed, js=ask("Delete this chat? It cannot be brought back."), api_name=False).then(**recover).then(
            chat.delete, [chat_state, confirmed], [chatbot, chat_state, chats, stats, depth_plot, rate_plot, notice], show_progress="hidden"
        ).then(**exports_shown).then(**remember)
        export.click(**recover).then(chat.export, chat_state, [exported, notice], show_progress="hidden")
        importer.upload(**recover).then(
            chat.import_chat, [importer, chat_state, colour], [chatbot, chat_state, system, stats, depth_plot, rate_plot, chats, notice],
            show_progress="hidden", api_name=False,
        ).then(**exports_shown).then(**remember).then(chat.name_of, chat_state, chat_name, show_progress="hidden", api_name=False)
        gr.on([rename.click, chat_name.submit], **recover).then(
            chat.rename, [chat_name, chat_state], [chat_state, chats, chat_name, notice], show_progress="hidden", api_name=False
        )
        shown_id.change(chat.name_of, chat_state, chat_name, show_progress="hidden", api_name=False)  # another chat shown: its name
        colour.change(chat.recolour, [chat_state, colour], chatbot, show_progress="hidden")
        # saved as typed (the last value too: always_last), not only when the box loses the focus, which a reload never gives
        gr.on([control.input for control in controls] + [system.input, system.blur], chat.remember, [system, shown_id, *controls], notice,
              show_progress="hidden", trigger_mode="always_last")  # fmt: skip

        # Compare and the benchmark release the tab's Stop at the click (arm), not when their turn
        # comes: a Stop pressed while they wait for the model then applies. Every press's run is sent
        # (trigger_mode), the page's last one pending or not: one that arm refused does nothing (a hidden box
        # says so), and one armed as the last run ended, before the page heard of that end, runs
        panes = [pane_vanilla, pane_eagle, pane_eagle2, verdict]
        compare_refused, bench_refused = gr.Checkbox(False, visible=False), gr.Checkbox(False, visible=False)
        gr.on([run_compare.click, prompt.submit], compare.arm, None, [*panes, compare_refused], concurrency_limit=None, show_progress="hidden", api_name=False).then(
            compare.compare, [prompt, with_eagle, compare_refused, *controls], panes, api_name="compare", trigger_mode="multiple", **STREAM
        )  # fmt: skip
        stop_compare.click(compare.stop, None, [verdict, bench_notice], concurrency_limit=None, show_progress="hidden")
        with_eagle.change(lambda on: gr.update(visible=on), with_eagle, eagle_column)
        bench_outputs = [bench_table, bench_chart, bench_json, bench_notice]
        run_bench.click(compare.arm_benchmark, None, [*bench_outputs, bench_refused], concurrency_limit=None, show_progress="hidden", api_name=False).then(
            compare.benchmark, [upload, limit, bench_refused, *controls], bench_outputs, show_progress_on=bench_table, trigger_mode="multiple", **MODEL
        )  # fmt: skip

        wanted_mode = gr.State(None)  # the mode this tab's user picked (or saved), given back when a model has it again
        entry.input(library.pick, [entry, quantization], [model_box, head_box, load_notice])
        quantization.input(library.refit, [entry, quantization], load_notice, show_progress="hidden", api_name=False)
        for box in (model_box, head_box):  # typed over: the boxes no longer hold the entry shown
            box.input(lambda: None, None, entry, show_progress="hidden", api_name=False)
        load.click(library.load_here, [model_box, head_box, trained, quantization, dtype], [status, load_notice, mode, wanted_mode],
                   show_progress_on=load_notice, **MODEL).then(  # a download's bars there, not on the Chat tab's mode
            library.heads, None, trained
        )  # fmt: skip
        unload.click(library.unload, None, [status, load_notice, mode], **MODEL).then(library.heads, None, trained)

        # a reload shows the chat this tab showed (kept in its sessionStorage); a new tab, the one opened last
        shown_id.change(None, shown_id, None, js=render.KEEP_SHOWN_JS, show_progress="hidden", api_name=False)
        demo.load(
            chat.restore_page, shown_id, [*controls, system, chatbot, chat_state, chats, stats, notice, wanted_mode], js=render.SHOWN_BACK_JS
        ).then(**saved_plots).then(**remember)
        demo.load(library.status, None, status).then(library.heads, None, trained)
        for box, key in ((message, "message"), (prompt, "compare-prompt")):  # what was typed survives a reload
            box.change(None, box, None, js=render.keep_typed_js(key), api_name=False)
            demo.load(None, None, box, js=render.typed_back_js(key), api_name=False)
        # what another tab loaded or unloaded since this page was opened
        models_tab.select(library.status, None, status, show_progress="hidden", api_name=False).then(library.heads, None, trained)
        mode.input(lambda picked: picked, mode, wanted_mode, show_progress="hidden", api_name=False)
        chat_tab.select(library.modes, [mode, wanted_mode], [mode, wanted_mode], show_progress="hidden", api_name=False)
    return demo


def access_from(args) -> Access:
    """The server's access rules from the command line. --listen (reachable
    from other machines) requires a page password and an API key."""
    credentials = None
    if args.auth is not None:
        user, colon, password = args.auth.partition(":")
        if not (user and colon and password):
            raise ValueError("--auth must be USER:PASS, both non-empty")
        credentials = (user, password)
    api_key = new_api_key() if args.api_key == "auto" else args.api_key
    if api_key is not None and len(api_key) < 8:
        raise ValueError("--api-key must be at least 8 characters (or auto to generate one)")
    if api_key is not None and not (api_key.isascii() and api_key.isprintable() and " " not in api_key):
        # an HTTP header carries ASCII only: clients cannot send such a key (the openai package fails on it)
        raise ValueError("--api-key must be letters, digits and ASCII punctuation, without spaces (or auto to generate one)")
    if args.listen and (credentials is None or api_key is None):
        missing = [option for option, value in (("--auth USER:PASS", credentials), ("--api-key auto", api_key)) if value is None]
        raise ValueError(
            "--listen makes Kestrel reachable from other machines, so it needs a page password and an API key: "
            f"add {' '.join(missing)} (or drop --listen to stay on this computer)"
        )
    origins = tuple(origin.rstrip("/") for origin in args.allow_origin or ())
    bad = [origin for origin in origins if not allowable_origin(origin)]
    if bad:
        raise ValueError(
            "--allow-origin takes an origin, scheme://host[:port] (http://localhost:3000, chrome-extension://ID), "
            f"SCHEME://* for every one of a browser's extensions (moz-extension://*; not http or https) or null, got {bad[0]!r}"
        )
    if "null" in origins and api_key is None:  # not only file:// pages: any web site can make a frame that sends null
        raise ValueError("--allow-origin null admits a sandboxed frame of any web site too, so it needs --api-key (auto generates one)")
    hosts = tuple(host.lower().rstrip(".") for host in getattr(args, "allow_host", None) or ())
    bad = [host for host in hosts if not HOST_NAME.fullmatch(host)]
    if bad:
        raise ValueError(f"--allow-host takes a host name without port, such as host.docker.internal, got {bad[0]!r}")
    given = getattr(args, "page_origin", None) or ()
    pages = tuple(origin.rstrip("/").lower() for origin in given)  # as a browser sends it
    for origin, named in zip(pages, given):
        if fault := page_origin_fault(origin):
            raise ValueError(f"--page-origin takes the page's address as the browser names it, http(s)://host[:port] "
                             f"(https://chat.example), got {named!r}: {fault}")  # fmt: skip
    return Access("0.0.0.0" if args.listen else LOCALHOST, credentials, api_key, origins, hosts, pages)


def page_origin_fault(origin: str) -> str | None:
    """What keeps `origin` (lower case) from being the origin of a page served
    behind a proxy, which a browser sends as scheme://host[:port]; None if nothing."""
    if origin == "null":
        return "null is the origin of file:// pages and of any web site's sandboxed frames, never the page's"
    scheme, separator, rest = origin.partition("://")
    if not separator:
        return "it has no scheme (http:// or https://)"
    if scheme not in ("http", "https"):
        return f"the page is served over http or https, not {scheme} (--allow-origin lets other pages call /v1)"
    if any(mark in rest for mark in "/?#"):
        return "an origin has no path, query or fragment"
    if "*" in rest:
        return "it takes no wildcards: give each address on its own"
    if not web_origin(origin):
        return "that is no host[:port]"
    if origin.endswith({"http": ":80", "https": ":443"}[scheme]):
        return f"a browser leaves the scheme's default port out: give {origin.rsplit(':', 1)[0]}"
    return None


def load_first(args, settings: dict, load_pair) -> Engine:
    """The model a start loads: the one named on the command line; where none
    is (no --model, --head, --quantization or --dtype), the one last loaded in
    the Models tab, as a desktop app opens with what was used last; where that
    one fails to load, or none was, the bundled model."""
    named = args.model or args.head or args.quantization != "auto" or args.dtype != "auto"
    choice = None if named else remembered_model(settings)
    if choice is not None and choice != {"model": None, "head": None, "quantization": "auto", "dtype": "auto"}:
        print(f"Loading {choice['model'] or 'the bundled model'} (last loaded in the Models tab; --model chooses another)...", flush=True)
        try:
            return load_pair(choice["model"], choice["head"], choice["quantization"], choice["dtype"], args.device, args.compile)
        except Exception as error:  # whatever it is, it must not keep Kestrel from starting
            if not isinstance(error, (KestrelError, ValueError)):
                log.exception("Loading the model last loaded in the Models tab failed")
            said = error_text(error)
        print(f"It did not load ({said}); loading the bundled model instead (--model chooses another).", flush=True)
        return load_pair(None, None, "auto", "auto", args.device, args.compile)  # once the failed load's memory is let go
    print(f"Loading {args.model}..." if args.model else "Loading the model (the first run prepares the bundled one)...", flush=True)
    return load_pair(args.model, args.head, args.quantization, args.dtype, args.device, args.compile)


def serve(args, lock: DataLock | None = None) -> int:
    """`launch.py ui`: load the model, then serve the page and the API until
    interrupted. lock: the data folder's, held already (the CLI takes it
    before importing this module, so that a second start answers at once)."""
    access = access_from(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from app.session import load_pair, prepare_costs
    from app.store import remove_leftovers
    from app.uploads import keep_private

    store_dir = data_dir()
    if lock is None:
        lock = DataLock(store_dir)
        if not lock.acquire():  # a second start (a double-click twice): the running one keeps the chats
            return tell_running(lock, store_dir, args.no_browser)
    remove_leftovers(store_dir)
    keep_private()  # before the page is built
    engine = load_first(args, Store(store_dir).load_settings(), load_pair)
    prepare_costs(engine)
    runtime = Runtime(engine, max_waiting=args.max_queue, reuse=not args.no_kept_caches)
    print(f"Loaded {runtime.describe()}", flush=True)
    if recommended := recommended_sampling(engine):  # as the Models tab says it after a load there
        print(recommended.strip(), flush=True)
    print(f"Chats and settings: {store_dir}", flush=True)
    server = Server(build_app(runtime, store_dir, args.device, args.compile), runtime, access, args.port)
    server.start()
    lock.announce(server.url)
    # a process started in the background inherits SIGINT ignored; "Press Ctrl+C to stop" must still hold
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # from here on a stop, however early, closes the server (saving the replies being written)
        if server.port != args.port:
            print(f"Port {args.port} is in use; using {server.port}.", flush=True)
        where = LOCALHOST if access.loopback else f"{access.host} (all interfaces; password and API key required)"
        print(f"Kestrel is running at {server.url} on {where}. Press Ctrl+C to stop.", flush=True)
        print(f"OpenAI-compatible API: base_url={server.url}v1  model={engine.base.name!r}", flush=True)
        if access.api_key is not None and args.api_key == "auto":
            print(f"API key (shown once): {access.api_key}", flush=True)
        if not args.no_browser:
            open_browser(server.url)
        server.wait()
    except KeyboardInterrupt:
        try:
            print("Stopping...", flush=True)
        except OSError:  # the terminal is gone (SIGHUP); the replies are saved all the same
            pass
    finally:
        runtime.stopping()  # the replies being written are saved as far as they got, before the process ends
        server.close()
    return 0
