"""The command line: ui (default), chat, bench, train-head, long-prompts, self-prompts, eval-heads, test."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
from pathlib import Path

from core.config import SEEDS, TOP_K_LIMIT
from models.paths import user_path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("ui", "chat", "bench", "bench-app", "train-head", "long-prompts", "self-prompts", "eval-heads", "test")


def integer(low: int, high: int | None = None):
    """An argparse type: an integer from `low` (to `high`), refused by the option's name."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {f'from {low} to {high}' if high is not None else f'at least {low}'}, got {value}")
        return value

    return parse


def thread_count(text: str) -> int:
    """An argparse type for --threads: from 1 to this computer's logical CPUs
    (more only wait on one another: on 2 cores, 10,000 threads did not finish a reply)."""
    value = integer(1)(text)
    cpus = os.cpu_count()
    if cpus is not None and value > cpus:
        raise argparse.ArgumentTypeError(f"this computer has {cpus} logical CPU{'s' if cpus > 1 else ''}; give at most {cpus}, got {value}")
    return value


def number(low: float, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite number from `low` (above it where low_open) up to `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or (high is not None and value > high):
            interval = f"{'above' if low_open else 'at least'} {low:g}" + (f" and at most {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be a number {interval}, got {text}")
        return value

    return parse


PORT = integer(1, 65535)


def tree_nodes(high: int):
    """An argparse type for --total-tokens: 0 (sized by the planner) or 2 to `high` (a tree is its root and a node at least)."""
    counted = integer(0, high)

    def parse(text: str) -> int:
        value = counted(text)
        if value == 1:
            raise argparse.ArgumentTypeError(f"must be 0 (sized by the planner) or from 2 to {high}, got 1")
        return value

    return parse


def add_model_options(parser: argparse.ArgumentParser, decoding: bool = True) -> argparse._ArgumentGroup:
    """decoding: the options of commands that decode (a draft head, compiled layers); train-head has neither.
    Returns the group, for a command's own model options."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", help="base model: Hugging Face repo id (owner/name, or owner/name@REV for a branch, tag or commit), local folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    if decoding:
        group.add_argument("--head", help="EAGLE draft head: Hugging Face repo id (owner/name, or owner/name@REV) or local folder (default: the bundled head of the default model, if any)")
    group.add_argument("--quantization", default="auto", choices=("auto", "none", "int4", "int8", "8bit", "4bit"), help="base model weights: int4 or int8 (CPU kernels; int4 Kestrel's own where a C++ compiler is found), 8bit or 4bit (bitsandbytes, for GPUs), or none; auto (default) = on CPUs int4 for a Q4_1 GGUF where Kestrel's int4 kernel is built, else int8 where it is measured faster, else none; on GPUs 4bit where the 16-bit weights would take more than 80%% of its memory, else none")
    group.add_argument("--dtype", default="auto", choices=("auto", "float64", "float32", "bfloat16", "float16"), help="compute dtype (default auto: bf16/fp16 on GPUs; bf16 on CPUs with native bf16, else float32)")
    if decoding:
        group.add_argument("--compile", default="auto", choices=("auto", "on", "graphs", "off"), help="torch.compile the base model's decoder layers, or replay its passes as CUDA graphs: auto (default) = compiled on Linux CPUs with a C++ compiler (g++ or clang++), in float32 or bf16 (the first run compiles for about a minute, later runs read the cache in seconds), CUDA graphs on NVIDIA GPUs; on (compiled), graphs (on a CPU: the same static passes, uncaptured; for checking them), or off (eager)")
    group.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    group.add_argument("--threads", type=thread_count, help="CPU threads for torch (default: torch's choice)")
    return group


def sampling_top_k(text: str) -> int:
    """An argparse type for --top-k: 0 to TOP_K_LIMIT, or -1, which the API takes for off (as vLLM does): 0."""
    return max(0, integer(-1, TOP_K_LIMIT)(text))


def add_sampling_options(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    # default None, read as 0: chat names a model's recommended settings where --temperature is not given (recommended_note)
    group.add_argument("--temperature", type=number(0.0, 2.0), default=None, help="0 = greedy (default); higher = more random (at most 2, as on the page and in the API)")
    group.add_argument("--top-p", type=number(0.0, 1.0), default=1.0, help="nucleus sampling mass (default 1.0 = off; 0 keeps the most likely token)")
    group.add_argument("--top-k", type=sampling_top_k, default=0, help=f"sample among the k most likely tokens (default 0 = off, as -1 is, which the API takes too; at most {TOP_K_LIMIT:,})")
    group.add_argument("--max-new-tokens", type=integer(1), default=max_new_tokens, help=f"most tokens to generate (default {max_new_tokens})")
    group.add_argument("--seed", type=integer(*SEEDS), help="random seed for sampling, a signed 64-bit integer (default, or -1: for a sampled reply, one drawn each run, and shown)")


def add_tree_options(parser: argparse.ArgumentParser) -> None:
    from core.config import TREE_LIMITS, TreeParams

    defaults = TreeParams()
    depth, top_k, lookup, branches = (integer(*TREE_LIMITS[field]) for field in ("depth", "top_k", "lookup_tokens", "context_branches"))
    total = tree_nodes(TREE_LIMITS["total_tokens"][1])
    group = parser.add_argument_group("draft tree (EAGLE-2)")
    group.add_argument("--total-tokens", type=total, default=defaults.total_tokens, help=f"tree nodes the head drafts per step, 2 to {TREE_LIMITS['total_tokens'][1]} (branches copied from the context come on top; --lookup-tokens 0 for none); 0 = sized every step from this device's measured costs (default 0)")
    group.add_argument("--depth", type=depth, default=defaults.depth, help=f"deepest draft of the head (a copied branch may reach deeper; default {defaults.depth})")
    group.add_argument("--tree-top-k", type=top_k, default=defaults.top_k, help=f"children per expanded node (default {defaults.top_k})")
    group.add_argument("--min-path-prob", type=number(0.0, 0.999), default=defaults.min_path_prob, help=f"stop deepening the tree when its best path is less likely than this, 0 = never (default {defaults.min_path_prob})")
    group.add_argument("--lookup-tokens", type=lookup, default=defaults.lookup_tokens, help=f"longest tree branch copied from the context after a repeated n-gram, 0 = off (default {defaults.lookup_tokens})")
    group.add_argument("--context-branches", type=branches, default=defaults.context_branches, help=f"copied branches from different earlier matches when trees are sized automatically (default {defaults.context_branches})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch.py", description="Kestrel: a local LLM chat with EAGLE-2 speculative decoding.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    ui = commands.add_parser("ui", help="start the chat in the browser (the default command)")
    add_model_options(ui)
    ui.add_argument("--port", type=PORT, default=7860, help="port to serve on, on 127.0.0.1 (all interfaces with --listen); default 7860, the next free one if taken")
    ui.add_argument("--no-browser", action="store_true", help="do not open the browser")
    ui.add_argument("--listen", action="store_true", help="serve on all network interfaces (requires --auth and --api-key)")
    ui.add_argument("--auth", help="USER:PASS for the page, required by --listen")
    ui.add_argument("--api-key", help="require this key as 'Authorization: Bearer KEY' on the /v1 API; auto = generate one and print it (required by --listen)")
    ui.add_argument("--allow-origin", action="append", metavar="ORIGIN", help="let web pages from ORIGIN call the /v1 API (CORS), not act as the page: http://localhost:3000, chrome-extension://ID, moz-extension://* (every extension), null (file:// pages; needs --api-key); repeatable")
    ui.add_argument("--page-origin", action="append", metavar="ORIGIN", help="the page's own address behind a proxy, http(s)://host[:port] (https://chat.example): the page served there may act here (chats, uploads, models) and call /v1; repeatable")
    ui.add_argument("--allow-host", action="append", metavar="NAME", help="answer requests that reach this computer by NAME too, as host.docker.internal from a container in Docker Desktop (Open WebUI, LibreChat); repeatable")
    ui.add_argument("--no-kept-caches", action="store_true", help="read every request's prompt afresh, never continuing an earlier request's caches (bench-app's server: each way then reads the prompt as the chat command does)")
    ui.add_argument("--max-queue", type=integer(1), default=16, help="requests that may wait for the model; more are refused with 429 (default 16)")
    ui.add_argument("--install-shortcut", action="store_true", help="create a desktop/menu shortcut and exit")

    chat = commands.add_parser("chat", help="answer one prompt in the terminal")
    chat.add_argument("prompt", help="the user message; - reads it from standard input")
    add_model_options(chat)
    add_sampling_options(chat, max_new_tokens=256)
    add_tree_options(chat)
    chat.add_argument("--mode", default=None, choices=("vanilla", "eagle", "eagle2"), help="decoding mode (default: eagle2 when a head is loaded, else vanilla)")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--warmup", type=integer(0, 8), default=0, help="first answer N built-in prompts untimed, at 16 tokens, so that the reply's figures are those of a warm process (bench-app's baseline; default 0)")

    bench = commands.add_parser("bench", help="benchmark decoding modes on a prompt file")
    bench.add_argument("--prompts", required=True, help="JSONL file; each line has a 'turns' list (first turn = prompt) and optionally 'id'")
    bench.add_argument("--limit", type=integer(1), help="use only the first N prompts")
    bench.add_argument("--per-source", type=integer(1), help="use the first N prompts of each source (e.g. chat and code)")
    bench.add_argument("--modes", default="vanilla,eagle2", help="comma-separated from vanilla, eagle, eagle2, generate, prompt-lookup, llama.cpp; eagle2:T/D/K[/L] sets a tree shape (default vanilla,eagle2)")
    bench.add_argument("--json", dest="json_out", help="write the full results to this JSON file")
    bench.add_argument("--warmup", type=integer(0), default=1, help="untimed warm-up prompts (default 1)")
    bench.add_argument("--llama-python", help="for mode llama.cpp: a Python with llama-cpp-python installed (llama.cpp as a measuring stick on the same GGUF)")
    bench.add_argument("--other-head", action="append", default=[], metavar="NAME=HEAD", help="another head (folder or repo id) on the same base model, for modes eagle2@NAME: two heads in one run (repeatable)")
    bench.add_argument("--turns", type=integer(1), default=1, help="run each prompt's first N user turns as one conversation, every mode answering with its own replies; later turns continue the last turn's caches and their first token is also timed read afresh (default 1)")
    bench.add_argument("--calibrate", action="store_true", help="measure this device's step costs again (they are cached per device, model, head, dtype, quantization, threads, torch version and kernels)")
    add_model_options(bench)
    add_sampling_options(bench, max_new_tokens=128)
    add_tree_options(bench)

    app_bench = commands.add_parser("bench-app", help="tokens/s of one prompt through the chat command, the API, the page's endpoint and the page in Chromium")
    app_bench.add_argument("--prompt", default="Write a Python function that checks whether a number is prime, and explain it.", help="the user message (default: a prime-check request)")
    app_bench.add_argument("--modes", default="vanilla,eagle2", help="comma-separated decoding modes (default vanilla,eagle2)")
    app_bench.add_argument("--max-new-tokens", type=integer(1, 32768), default=256, help="most tokens per reply, at most 32768 as on the page (default 256)")
    app_bench.add_argument("--threads", type=thread_count, default=min(2, os.cpu_count() or 2), help="CPU threads of the chat command and the server (default 2)")
    app_bench.add_argument("--rounds", type=integer(1), default=2, help="rounds of every way and mode; the table shows medians (default 2)")
    app_bench.add_argument("--port", type=PORT, default=7877, help="port of the server it starts (default 7877)")
    app_bench.add_argument("--root", default=str(ROOT), help="the Kestrel folder whose launch.py to measure (default: this one)")
    app_bench.add_argument("--json", dest="json_out", help="write the rows to this JSON file")

    train = commands.add_parser("train-head", help="train an EAGLE draft head on the model's own answers")
    train.add_argument("--prompts", required=True, help="JSONL file; each line has a 'turns' list (first turn = prompt) and optionally a unique 'id' (default: its line)")
    train.add_argument("--out", required=True, help="folder for the trained head (config.json, model.safetensors, report)")
    train.add_argument("--work", help="folder for the resumable caches: answers, features, checkpoints (default: OUT/work)")
    add_model_options(train, decoding=False)  # --init-head starts from a head
    train.add_argument("--samples-per-prompt", type=integer(1), default=2, help="answers per prompt: the first greedy, the others sampled (default 2)")
    train.add_argument("--max-new-tokens", type=integer(2), default=256,
                       help="longest answer in tokens, 2 or more (an answer teaches from its second token on; default 256)")  # fmt: skip
    train.add_argument("--answer-temperature", type=number(0.0, 2.0, low_open=True), default=0.7, help="temperature of the sampled answers, above 0 and at most 2 (the first answer of each prompt is the greedy one; default 0.7)")
    train.add_argument("--answer-batch", type=integer(1), default=32, help="prompts per generate call (default 32)")
    train.add_argument("--max-prompt-tokens", type=integer(1), default=512, help="prompts longer than this many tokens are skipped (default 512; raise it for long-prompts' files)")
    train.add_argument("--epochs", type=integer(1), default=2, help="passes over the training features (default 2)")
    train.add_argument("--learning-rate", type=number(0.0, low_open=True), default=1e-3, help="peak AdamW learning rate (default 1e-3)")
    train.add_argument("--batch-tokens", type=integer(1), default=2048, help="padded positions per training step (default 2048)")
    train.add_argument("--draft-vocab", type=integer(0), default=8192, help="the head drafts among this many most frequent answer tokens; 0 = the whole vocabulary (default 8192)")
    train.add_argument("--arch", default="eagle2", choices=("eagle2", "eagle3"), help="eagle2: an EAGLE-1/2 head on the final features; eagle3: an EAGLE-3 head on three captured layers, its own lm_head over the draft vocabulary, no feature loss (default eagle2)")
    train.add_argument("--unroll-steps", type=integer(1), default=3, help="draft steps trained per position, 1 = plain EAGLE (default 3)")
    train.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="training compute: bf16 autocast or fp32 (default bf16)")
    train.add_argument("--time-budget-minutes", type=number(0.0, low_open=True), help="stop (resumably) after this long; answers get --answer-share of it")
    train.add_argument("--answer-share", type=number(0.0, 1.0), default=0.4, help="share of the time budget for generating answers (default 0.4)")
    train.add_argument("--init-head", help="start from this head folder's weights (continue training it or fine-tune it on new prompts)")
    train.add_argument("--resume", action="store_true", help="continue from the caches in the work folder")
    train.add_argument("--seed", type=integer(0, SEEDS[1]), default=0, help="seed of sampling, noise, init and batch order (default 0)")

    long = commands.add_parser("long-prompts", help="write long-document training prompts (summaries, questions over passages) made from the model's own answers")
    long.add_argument("--prompts", required=True, help="JSONL prompt file whose answers become the documents' passages")
    long.add_argument("--out", required=True, help="JSONL file to write the long prompts to (for train-head --prompts)")
    long.add_argument("--work", required=True, help="folder for the cached answers (a rerun reuses them)")
    add_model_options(long, decoding=False)
    long.add_argument("--documents", type=integer(4), default=400, help="prompts answered to make passages: the first this many (default 400)")
    long.add_argument("--count", type=integer(1), default=300, help="long prompts to write (default 300)")
    long.add_argument("--min-tokens", type=integer(1), default=800, help="shortest document, about, in tokens (default 800)")
    long.add_argument("--max-tokens", type=integer(1), default=1500, help="longest document in tokens (default 1500)")
    long.add_argument("--max-new-tokens", type=integer(1), default=256, help="longest passage (answer) in tokens (default 256)")
    long.add_argument("--min-passage-tokens", type=integer(1), default=40, help="shorter answers make no passage (default 40)")
    long.add_argument("--answer-batch", type=integer(1), default=32, help="prompts per generate call (default 32)")
    long.add_argument("--seed", type=integer(0, SEEDS[1]), default=0, help="seed of the passages' choice and the templates (default 0)")

    own = commands.add_parser("self-prompts", help="write training prompts on new topics: the model writes users' requests itself, each started from a few words of a file prompt")
    own.add_argument("--prompts", required=True, help="JSONL prompt file whose prompts lend each request its opening words (its held-out prompts never do)")
    own.add_argument("--out", required=True, help="JSONL file to write the requests to (for train-head --prompts)")
    own.add_argument("--work", required=True, help="folder for the cached requests (a rerun reuses them, a stopped run resumes)")
    add_model_options(own, decoding=False)
    own.add_argument("--count", type=integer(1, 1_000_000), default=2000, help="requests to generate, at most 1,000,000; unfinished, short and repeated ones are left out (default 2000)")
    own.add_argument("--max-new-tokens", type=integer(1), default=128, help="longest request in tokens; longer ones are left out (default 128)")
    own.add_argument("--temperature", type=number(0.0, 2.0, low_open=True), default=1.0, help="sampling temperature of the requests, above 0 and at most 2 (default 1)")
    own.add_argument("--opening-words", type=integer(0), default=3, help="each request starts from the first 0 to this many words of a file prompt (default 3)")
    own.add_argument("--answer-batch", type=integer(1), default=32, help="requests per generate call (default 32)")
    own.add_argument("--keep-prompts", action="store_true", help="write the --prompts file's own lines first, so that --out trains on both")
    own.add_argument("--seed", type=integer(0, SEEDS[1]), default=0, help="seed of the sampling and the openings; another seed writes other requests, with other ids (default 0)")

    judge = commands.add_parser("eval-heads", help="held-out top-1 of draft heads (any kind) on the same stored features")
    judge.add_argument("--features", required=True, help="a features folder of train-head (WORK/features-eagle3 serves every kind of head)")
    judge.add_argument("--split", default="eval", choices=("eval", "train"), help="which shards to judge on (default eval: the held-out prompts)")
    judge.add_argument("--steps", type=integer(1), default=3, help="draft steps, each fed the head's own earlier output (default 3)")
    judge.add_argument("--json", dest="json_out", help="write the figures to this JSON file")
    judged = add_model_options(judge, decoding=False)  # judged on stored features: nothing decodes, nothing compiles
    judged.add_argument("--head", help="a head folder or Hugging Face repo id to judge (default: the bundled head, for the bundled model)")
    judge.add_argument("heads", nargs="*", metavar="HEAD", help="more head folders or Hugging Face repo ids")

    test = commands.add_parser("test", help="run the test suite (extra arguments go to pytest)")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER)
    return parser


PYTEST_VALUED = ("-k", "-m", "-p", "-o", "-c", "-W", "--tb", "--durations", "--maxfail", "--rootdir", "--basetemp",
                 "--junitxml", "--junit-xml", "--log-file", "--confcutdir")  # fmt: skip
PYTEST_PATHS = ("--deselect", "--ignore")  # options whose value is a test path, read as the tests named are


def takes_value(option: str) -> bool:
    """Whether pytest reads the argument after `option` as its value: a valued
    option, alone or last of short flags written together (-xk NAME; in
    -kNAME the value is attached)."""
    if option in PYTEST_VALUED:
        return True
    if option[:1] != "-" or option[1:2] in ("", "-"):
        return False
    for index, letter in enumerate(option[1:], start=1):
        if f"-{letter}" in PYTEST_VALUED:
            return index == len(option) - 1
    return False


def pytest_arguments(extra: list[str], cwd: Path) -> list[str]:
    """`launch.py test [ARGS]` -> pytest's arguments: the whole suite, or the
    test files and folders named (`tests/test_tree.py`, `tests/test_api.py::test_x`),
    read from the current folder or else from Kestrel's, wherever it is started."""
    arguments, named = [], False
    for index, argument in enumerate(extra):
        option = extra[index - 1] if index else ""
        if not argument.startswith("-") and not takes_value(option):
            path, _, test = argument.partition("::")
            where = next((folder / path for folder in (cwd, ROOT) if (folder / path).exists()), None)
            if where is not None:
                argument = str(where) + (f"::{test}" if test else "")
                named = named or option not in PYTEST_PATHS
        arguments.append(argument)
    return arguments if named else [str(ROOT / "tests"), *arguments]


def main(argv: list[str]) -> int:
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} (see launch.py --help)", file=sys.stderr)
        return 2
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["ui", *argv]
    if argv[0] == "test":  # pytest owns every later argument
        import pytest

        return pytest.main(pytest_arguments(argv[1:], Path.cwd()))
    args = build_parser().parse_args(argv)
    import logging

    # Kestrel's own progress messages ("kestrel" logger) go to the terminal as plain lines, on
    # stderr: `chat ... > reply.txt` keeps the reply without "Compiling the model..."
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("kestrel").addHandler(handler)
    logging.getLogger("kestrel").setLevel(logging.INFO)

    from models.errors import KestrelError

    SIGNALLED.clear()  # of this command (tests run several in one process)
    if args.command in ("train-head", "ui", "bench-app", "bench"):
        # kill, logout, shutdown or a closed terminal end these as Ctrl-C does:
        # train-head saves its checkpoint and clock, the page saves the replies being written, bench-app stops its server
        import signal

        for name in ("SIGTERM", "SIGHUP"):  # no SIGHUP on Windows
            # only where the signal would kill: `nohup` (SIGHUP ignored) keeps a server running past logout
            if hasattr(signal, name) and signal.getsignal(getattr(signal, name)) == signal.SIG_DFL:
                signal.signal(getattr(signal, name), _interrupted)
    try:
        if args.command == "ui":
            if args.install_shortcut:
                return install_shortcut(args)
            # the data folder's lock before the page's imports (seconds): a second start (a double-click twice) answers at once
            from app.instance import DataLock, data_dir, tell_running

            lock = DataLock(data_dir())
            if not lock.acquire():
                return tell_running(lock, data_dir(), args.no_browser)
            from app.ui import serve

            return serve(args, lock)
        if args.command == "chat":
            return run_chat(args)
        if args.command == "bench":
            return run_bench_command(args)
        if args.command == "bench-app":
            return run_app_bench_command(args)
        if args.command == "train-head":
            return run_train_head(args)
        if args.command == "eval-heads":
            return run_eval_heads(args)
        if args.command == "long-prompts":
            return run_long_prompts(args)
        if args.command == "self-prompts":
            return run_self_prompts(args)
    except KestrelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # bad option values and prompt files, named by their messages
        print(f"error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout went away (`chat ... | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush finds no pipe either
        return 1
    except OSError as error:  # a port in use, a file that cannot be written
        hint = resume_hint(args)
        print(f"error: {error}{f'; {hint} once that is fixed' if hint else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = resume_hint(args)
        print(f"\ninterrupted{f' ({hint} to continue)' if hint else ''}", file=sys.stderr)
        return 130
    return 0


def install_shortcut(args: argparse.Namespace) -> int:
    """`ui --install-shortcut`: the desktop/menu shortcut, starting Kestrel with the other options given."""
    from app.shortcut import install

    written = install(options=shortcut_options(args))
    for path in written:
        print(f"Shortcut written: {path}")
    if sys.platform.startswith("linux") and len(written) == 1:
        print("No desktop folder was found (~/Desktop, or XDG_DESKTOP_DIR in ~/.config/user-dirs.dirs): only the menu entry was written")
    return 0


def shortcut_options(args: argparse.Namespace) -> list[str]:
    """The page's options of this start that differ from their defaults, for
    its shortcut to start Kestrel with: a --model or --head folder or file made
    absolute (the shortcut starts in Kestrel's folder). ValueError for a
    password or key, which the shortcut's file would hold in plain text."""
    parser = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)).choices["ui"]
    options = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "install_shortcut") or value == action.default:
            continue
        name = action.option_strings[-1]
        if action.dest == "auth" or (action.dest == "api_key" and value != "auto"):
            raise ValueError(f"{name}: a shortcut keeps no passwords or keys (its file would hold them in plain text); "
                             f"make it without {name}, or start Kestrel from a terminal with it")  # fmt: skip
        if action.nargs == 0:  # a switch
            options.append(name)
            continue
        for item in value if isinstance(value, list) else [value]:
            path = Path(str(item)).expanduser()
            given = str(path.resolve()) if action.dest in ("model", "head") and path.exists() else str(item)
            options += [name, given]
    return options


SIGNALLED: list[int] = []  # the kills and hang-ups _interrupted took


def _interrupted(signum, frame):
    # noted first: a raise that lands in a finalizer or a weakref callback (as imports and a model's load
    # run them) is only reported by Python, and the command would run on; the decoding then stops at once
    SIGNALLED.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_interrupt():
    """A signal that Ctrl+C sets while decoding, instead of raising where it
    lands: raised inside a compiled layer's kernel it surfaced as a RuntimeError
    traceback. The decoding stops within a step; a second Ctrl+C raises at once."""
    import signal
    import threading

    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    # only where the signal would raise: an ignored SIGINT (a background job) stays ignored; a kill or
    # hang-up where main() made them raise as Ctrl+C does (bench) stops the decoding the same way
    previous = {number: signal.getsignal(number) for number in
                [signal.SIGINT, *(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))]}  # fmt: skip
    taken = [number for number, handler in previous.items() if handler in (signal.default_int_handler, _interrupted)]

    def interrupted(signum, frame):
        stop.set()
        for number in taken:  # a second signal raises at once
            signal.signal(number, previous[number])

    for number in taken:
        signal.signal(number, interrupted)
    if SIGNALLED:  # a kill before the decoding whose KeyboardInterrupt was lost (_interrupted)
        stop.set()
    try:
        yield stop
    finally:
        for number in taken:
            signal.signal(number, previous[number])


def check_writable(path: str, option: str, reads: list[tuple[str, str | Path | None]] = ()) -> Path:
    """Refuse an output file that cannot be written, or that is a file the
    command reads or lies in a folder it reads (`reads`: (what, path) of its
    inputs; a repo id, or None, is no local one), before any work is done (a
    long run would otherwise end in a traceback and lose its results, or its input)."""
    import tempfile

    target = user_path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder; name a file")
    for what, source in reads:
        read = user_path(source).resolve() if source is not None else None
        if read is None or not read.exists():
            continue
        if target.resolve() == read:
            raise ValueError(f"{option} {path}: is the file this command reads ({what}); name another file for the results")
        if target.exists() and read in target.resolve().parents:  # a file of a head's, a model's or the features' folder
            raise ValueError(f"{option} {path}: would write over a file inside {source}, the {what} folder this command "
                             "reads; name a new file, or one outside it, for the results")  # fmt: skip
    missing = [folder for folder in target.parents if not folder.exists()]  # the deepest first
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".check"):
            pass
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write there ({error.strerror or error})") from error
    finally:  # made for the check alone: a run that fails or is stopped leaves no folders of a mistyped path
        for folder in missing:  # the writing makes them again
            try:
                folder.rmdir()
            except OSError:
                break
    return target


@contextlib.contextmanager
def working_in(work: Path, command: str):
    """Hold `work` for this command while it runs (an OS file lock, gone with
    the process however it ends): a second run in the same folder would write
    its answers and features among this one's."""
    from app.instance import DataLock
    from core.training.work import LOCK_FILE

    lock = DataLock(work, LOCK_FILE)
    if not lock.acquire():
        raise ValueError(busy_text(work, lock.holder(), command))
    lock.announce(command)  # for a refused second run to name
    try:
        yield
    finally:
        lock.release()


def busy_text(work: Path, holder: str, command: str) -> str:
    """The refusal of a run in a work folder that another run holds."""
    other = f"{holder} run" if holder in ("train-head", "long-prompts", "self-prompts") else "Kestrel command"
    return (f"{work}: another {other} is working in this folder; wait for it to end, or choose another "
            f"{'--out/--work' if command == 'train-head' else '--work'}")  # fmt: skip


def held_by(work: Path) -> str | None:
    """The command holding `work` now (working_in), or None where none does."""
    from app.instance import DataLock
    from core.training.work import LOCK_FILE

    if not (work / LOCK_FILE).is_file():
        return None
    lock = DataLock(work, LOCK_FILE)
    if lock.acquire():
        lock.release()
        return None
    return lock.holder()


def training_work(args) -> Path:
    """train-head's work folder: --work, else OUT/work."""
    return user_path(args.work) if args.work else user_path(args.out) / "work"


def resume_hint(args) -> str:
    """What a train-head run stopped by an error or Ctrl+C says about --resume: only where there is something to resume.
    Asked from the error handlers, where a Ctrl+C may have come while torch was being imported: nothing here imports it."""
    if args.command != "train-head":
        return ""
    from core.training.work import holds_a_run

    if not holds_a_run(training_work(args)):
        return ""
    return "the work done so far is kept: run the same command with --resume"


def recorded_quantization(work: Path, asked: str) -> str:
    """The quantization to load the base model with for a run on `work`: the
    one asked for, except that auto (a probe of a few milliseconds, which can
    decide otherwise from one run to the next) keeps the one the work's answers
    and features were made with, so that the same command resumes them."""
    from core.training.pipeline import recorded_base

    recorded = (recorded_base(work) or {}).get("quantization")
    if asked != "auto" or recorded not in ("none", "int4", "int8", "4bit"):  # 4bit: auto on a GPU where 16 bits do not fit
        return asked
    print(f"--quantization auto: {recorded}, as {work}'s answers and features were made", flush=True)
    return recorded


def written_by_run(out: Path, work: Path) -> bool:
    """Whether the head in `out` was written by the run whose work `work`
    holds: its report records that run's id. A head whose report records none
    (downloaded, someone's own, or written before runs were recorded) is
    not taken for the run's."""
    import json

    from core.training.report import REPORT_FILE
    from core.training.work import run_id

    try:
        recorded = json.loads((out / REPORT_FILE).read_text(encoding="utf-8")).get("run")
    except (OSError, ValueError, AttributeError):
        return False
    return recorded is not None and recorded == run_id(work)


def earlier_arch(out: Path) -> str | None:
    """The --arch of the head in `out`: from the report of the train-head run
    that wrote it, else (a report without one, or none) told by the head's own
    keys; None where `out` holds no readable head."""
    import json

    from core.training.report import REPORT_FILE
    from models import eagle3
    from models.head import head_keys

    try:
        arch = json.loads((out / REPORT_FILE).read_text(encoding="utf-8")).get("arch")
    except (OSError, ValueError, AttributeError):
        arch = None
    if isinstance(arch, str):
        return arch
    keys = head_keys(out)
    if keys is None:  # no head there, or one that does not read
        return None
    return "eagle3" if eagle3.is_eagle3(keys) else "eagle2"


def check_initial_head(path: str, arch: str) -> None:
    """--init-head of the kind this run trains, before the model loads (its
    shapes are checked against the base model before any answer is made)."""
    from models import eagle3
    from models.head import read_checkpoint

    if arch == "eagle3":
        raise ValueError("--init-head continues EAGLE-1/2 heads (--arch eagle2) only; an EAGLE-3 head is trained from scratch")
    _, state, _ = read_checkpoint(user_path(path))
    if eagle3.is_eagle3(state):
        raise ValueError(f"--init-head {path}: is an EAGLE-3 head; --init-head continues EAGLE-1/2 heads (--arch eagle2) only")


def check_head_folder(path: str, option: str) -> None:
    """A head folder's files are there (its shapes are checked when it loads)."""
    from models.head import CONFIG_FILE, WEIGHT_FILES

    folder = user_path(path)
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: {'is a file; give its folder' if folder.exists() else 'no such folder'}")
    missing = [] if (folder / CONFIG_FILE).is_file() else [CONFIG_FILE]
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        missing.append(WEIGHT_FILES[0])
    if missing:
        raise ValueError(f"{option} {path}: no {' or '.join(missing)}; not a draft-head folder")


def bench_modes(text: str) -> tuple[str, ...]:
    """--modes: each mode once, at least one."""
    modes = tuple(mode.strip() for mode in text.split(",") if mode.strip())
    if not modes:
        raise ValueError("--modes: name at least one mode, e.g. vanilla,eagle2")
    repeated = sorted({mode for mode in modes if modes.count(mode) > 1})
    if repeated:
        raise ValueError(f"--modes names {', '.join(repeated)} more than once; each mode runs once per prompt")
    return modes


def check_distinct(modes: tuple[str, ...], tree) -> None:
    """--modes: no two labels that run the same decoding (eagle2:8/4/4 and eagle2:08/4/4,
    or eagle2 and the shape the tree options give it)."""
    from core.bench import head_of, parse_mode

    seen: dict = {}
    for mode in modes:
        decoding = (head_of(mode), *parse_mode(mode, tree))
        if decoding in seen:
            raise ValueError(f"--modes {seen[decoding]} and {mode} run the same decoding; name it once")
        seen[decoding] = mode


def set_threads(threads: int | None) -> None:
    """--threads: torch's CPU threads (None: torch's choice)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def load_engine(args, with_head: bool = True):
    """The base model and its head from the command-line options (the base
    model alone where with_head is False)."""
    from app.session import load_pair

    set_threads(args.threads)
    return load_pair(args.model, args.head, args.quantization, args.dtype, args.device, args.compile, with_head)


def sampling_from(args):
    from core.config import SamplingParams

    seed = None if args.seed == -1 else args.seed  # -1 draws one, as in the API
    temperature = 0.0 if args.temperature is None else args.temperature  # greedy unless --temperature is given
    sampling = SamplingParams(temperature, args.top_p, args.top_k, args.max_new_tokens, seed)
    return sampling.seeded()  # drawn here, so that the output can name it


def tree_from(args):
    """The tree settings; a fixed --total-tokens that --depth and --tree-top-k cannot fill is said on stderr."""
    from core.config import TreeParams

    tree = TreeParams(args.total_tokens, args.depth, args.tree_top_k, args.min_path_prob, args.lookup_tokens, args.context_branches)
    note = tree.shortfall(("--total-tokens", "--depth", "--tree-top-k"))
    if note:
        print(f"Note: {note}", file=sys.stderr, flush=True)
    return tree



def check_text(text: str | None, what: str) -> None:
    """Refuse text that is not UTF-8: Python reads the command line and standard
    input with surrogate escapes, so a byte that is not UTF-8 (a Latin-1 file
    piped into `chat -`) arrives as a lone surrogate, which no tokenizer encodes."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        character = text[error.start]
        byte = f"byte 0x{ord(character) - 0xDC00:02x}" if 0xDC80 <= ord(character) <= 0xDCFF else f"{character!r}"
        raise ValueError(f"{what} is not UTF-8 text ({byte} at character {error.start}): save it as UTF-8") from error


def read_stdin() -> str:
    """Standard input's text, its bytes read as UTF-8 whatever the locale says
    (one that is not becomes what check_text names, not a codec's error)."""
    if sys.stdin is None:  # closed (`<&-`), or none given to the process
        raise ValueError("the prompt is - (standard input), and there is none: give the message as an argument, or pipe it in")
    if sys.stdin.isatty():  # typed: say how it ends, which a terminal does not
        end = "Ctrl+Z, then Enter" if os.name == "nt" else "Ctrl+D"
        print(f"type the message, then end it with {end} on a line of its own", file=sys.stderr, flush=True)
    raw = getattr(sys.stdin, "buffer", None)
    # line ends as sys.stdin.read() gives them (on Windows it turns \r\n into \n)
    return sys.stdin.read() if raw is None else raw.read().decode("utf-8", "surrogateescape").replace("\r\n", "\n")


def run_chat(args) -> int:
    sampling, tree = sampling_from(args), tree_from(args)  # a bad value fails before the model loads
    if args.prompt == "-":
        args.prompt = read_stdin()
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give the message to answer")
    for text, what in ((args.prompt, "the prompt"), (args.system, "--system")):
        check_text(text, what)
    if args.mode in ("eagle", "eagle2") and not args.head:
        from app.session import check_source, default_head

        check_source(args.model)  # a mistyped path is said as one, not as a base without a head
        if default_head(args.model) is None:  # said before a model loads for minutes
            raise ValueError(f"--mode {args.mode} needs a draft head: give --head HEAD (a head trained for this model), or --mode vanilla")
    if args.mode == "vanilla" and args.head:  # not loaded, so not checked either: say so rather than seem to use it
        print(f"note: --mode vanilla decodes without a draft head; --head {args.head} is not loaded", file=sys.stderr, flush=True)
    engine = load_engine(args, with_head=args.mode != "vanilla")  # vanilla needs no head: not loaded, not compiled
    from core.engine import Reading

    if args.temperature is None and (note := recommended_note(engine)):
        print(note, file=sys.stderr, flush=True)
    mode = args.mode or ("eagle2" if "eagle2" in engine.modes else "vanilla")
    if args.mode is None and engine.head is not None and mode == "vanilla":  # as the page and the API do
        print(f"note: answering with vanilla decoding: {engine.speculation_problem()}", file=sys.stderr, flush=True)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    check_room(engine, messages, sampling.max_new_tokens)  # before the step costs are measured
    if tree.planned and mode == "eagle2":
        from app.session import prepare_costs

        prepare_costs(engine)
    step, wrote = None, False
    progress = sys.stderr.isatty()  # how far a long prompt is read, on one line that the reply replaces
    with stop_on_interrupt() as stop:
        warm_up(engine, mode, sampling, tree, args.warmup, stop)
        for step in engine.chat(messages, mode=mode, sampling=sampling, tree=tree, cancel=stop, reading=progress):
            if isinstance(step, Reading):
                print(f"\rreading the prompt: {step.done / step.total:.0%} of {step.total:,} tokens", end="", file=sys.stderr, flush=True)
                continue
            if step.stats.forwards == 1 and progress:
                print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)  # no escape codes: old Windows consoles print them
            print(step.text, end="", flush=True)
            wrote = wrote or bool(step.text.strip())
    if step.finish_reason == "cancelled" and not step.stats.tokens:
        raise KeyboardInterrupt  # stopped while reading the prompt: nothing to report
    stats = step.stats
    print(flush=True)  # the reply's end; its figures go to stderr, so that `chat ... > reply.txt` holds the reply alone
    if not wrote and step.finish_reason == "stop":
        print("note: the model ended its reply without writing anything", file=sys.stderr)
    print(
        f"\n[{mode}] {stats.tokens} tokens in {stats.seconds:.2f} s: {stats.tokens_per_s:.1f} tokens/s"
        f"{'' if stats.decoding_tokens_per_s is None else f' ({stats.decoding_tokens_per_s:.1f} after the first token)'}, "
        f"tau {stats.mean_accepted_length:.2f}, trees of {stats.mean_tree_size:.1f} nodes (depth {stats.mean_tree_depth:.1f}), "
        f"first token after {stats.time_to_first_token:.2f} s, "
        f"{'' if sampling.greedy else f'seed {sampling.seed}, '}finished: {step.finish_reason}{ENDINGS.get(step.finish_reason, '')}",
        file=sys.stderr,
    )
    return 130 if step.finish_reason == "cancelled" else 0


ENDINGS = {"context": " (the reply reached the model's context window)"}  # said after the finish reason


def warm_up(engine, mode: str, sampling, tree, count: int, stop) -> None:
    """`count` of bench's built-in warm-up prompts answered untimed, at 16
    tokens, none of them the prompt: a process's first reply (allocations, the
    planner's calibration learnt from nothing) is not the one timed."""
    from dataclasses import replace

    from core.bench import WARMUP_TOKENS, warmup_messages

    for index in range(count):
        for _ in engine.chat(warmup_messages(index), mode=mode, sampling=replace(sampling, max_new_tokens=WARMUP_TOKENS), tree=tree, cancel=stop):
            pass


def recommended_note(engine) -> str:
    """Where the model's generation_config.json recommends sampling settings
    (Qwen3's temperature 0.6: greedy decoding can make its reasoning repeat
    itself), a note naming them and the options that set them; "" otherwise.
    chat stays greedy without --temperature, as documented: the note says so
    rather than take them silently as the API does (app/request.model_defaults)."""
    from app.request import model_defaults

    recommended = model_defaults(engine.model)
    if not recommended:
        return ""
    listed = ", ".join(f"{name} {value:g}" for name, value in recommended.items())
    options = " ".join(f"--{name.replace('_', '-')} {value:g}" for name, value in recommended.items())
    return (f"note: the model recommends sampling with {listed} (its generation_config.json); this reply is greedy "
            f"(--temperature 0, the default): add {options} to sample as it recommends")  # fmt: skip


def check_room(engine, messages: list[dict], max_new_tokens: int) -> None:
    """A prompt too long for the model's context window, refused with what to
    shorten; one that leaves the reply less than --max-new-tokens, said first."""
    from core.engine import ContextOverflowError, check_prompt

    prompt_ids = engine.encode(messages)
    try:
        check_prompt(engine, prompt_ids)
    except ContextOverflowError as error:
        over = len(prompt_ids) - engine.context_limit + 1
        which = "the prompt or --system" if len(messages) > 1 else "the prompt"
        raise ValueError(f"{error}: shorten {which} by at least {over:,} token{'' if over == 1 else 's'}, and more to leave room for the reply") from None
    room = engine.context_limit - len(prompt_ids)
    if room < max_new_tokens:
        print(f"note: the prompt is {len(prompt_ids):,} tokens of the model's context window of {engine.context_limit:,}: "
              f"the reply can be {room:,} tokens long at most, not --max-new-tokens {max_new_tokens:,}", file=sys.stderr, flush=True)  # fmt: skip


def prompt_job_paths(args, written: str, cache: str, cached: str) -> tuple[Path, Path, Path]:
    """(prompts, out, work) of a command that writes training prompts
    (long-prompts, self-prompts), checked before its model loads: `written`
    names what --out gets, `cache` the file it keeps in --work, `cached` what
    that holds."""
    from core.prompt import PromptFileError
    from core.training.answers import training_ids

    prompts, out, work = user_path(args.prompts), user_path(args.out), user_path(args.work)
    if not training_ids(prompts):
        raise PromptFileError(f"{args.prompts}: no prompts")
    if out.resolve() == prompts.resolve():
        raise ValueError(f"--out {args.out}: is the --prompts file; write the {written} to another file")
    if out.resolve() == work.resolve() or out.resolve() in work.resolve().parents:  # a folder, once --work is made
        holds = "is the --work folder" if out.resolve() == work.resolve() else "is a folder that holds the --work folder"
        raise ValueError(f"--out {args.out}: {holds} {args.work}; name a JSONL file for the {written}")
    if out.is_dir():
        raise ValueError(f"--out {args.out}: is a folder; name a JSONL file")
    if out.resolve() == (work / cache).resolve():
        raise ValueError(f"--out {args.out}: is where --work keeps {cached}; write the {written} to another file")
    check_writable(str(out), "--out")
    if work.exists() and not work.is_dir():
        raise ValueError(f"--work {args.work}: is a file; name a folder for {cached}")
    check_writable(str(work / cache), "--work")
    return prompts, out, work


def run_long_prompts(args) -> int:
    import json

    from app.store import write_atomic
    from core.training.answers import AnswerParams
    from core.training.documents import DOCUMENTS_FILE, LongParams, long_prompts
    from core.training.pipeline import check_base_model
    from models.base import load_base

    set_threads(args.threads)
    if args.min_tokens > args.max_tokens:
        raise ValueError(f"--min-tokens {args.min_tokens}: is above --max-tokens {args.max_tokens}")
    if args.min_passage_tokens > args.max_new_tokens:  # no answer could make a passage
        raise ValueError(f"--min-passage-tokens {args.min_passage_tokens}: is above --max-new-tokens {args.max_new_tokens}, "
                         "the longest answer; lower it or raise --max-new-tokens")  # fmt: skip
    prompts, out, work = prompt_job_paths(args, "long prompts", DOCUMENTS_FILE, "the answers the documents are made of")
    with working_in(work, "long-prompts"):
        base = load_base(args.model, recorded_quantization(work, args.quantization), args.dtype, args.device)
        check_base_model(work, base)  # answers cached there by another model would be its text, or its token ids
        answers = AnswerParams(1, args.max_new_tokens, 0.7, args.answer_batch, seed=args.seed)
        params = LongParams(args.count, args.min_tokens, args.max_tokens, args.seed, args.min_passage_tokens)
        rows = long_prompts(base, prompts, work, args.documents, params, answers)
    write_atomic(out, "".join(json.dumps(row) + "\n" for row in rows), shared=True)
    print(f"{len(rows)} long prompts written to {out}; train on them with train-head --prompts {out} --max-prompt-tokens {args.max_tokens + 200}")
    return 0


def run_self_prompts(args) -> int:
    import json

    from app.store import write_atomic
    from core.training.answers import training_ids
    from core.training.pipeline import check_base_model
    from core.training.self_prompts import REQUESTS_FILE, SelfParams, generate_requests, prepare_requests
    from models.base import load_base

    set_threads(args.threads)
    prompts, out, work = prompt_job_paths(args, "requests", REQUESTS_FILE, "the cached requests")
    params = SelfParams(args.count, args.max_new_tokens, args.temperature, args.opening_words, args.answer_batch, args.seed)
    kept = [{**row, "id": pid} for pid, row in training_ids(prompts).items()] if args.keep_prompts else []
    with working_in(work, "self-prompts"):
        # another file's openings, or other settings, than the cached requests': said before the model loads
        planned = prepare_requests(prompts, work, params)
        clash = {row["id"] for row in kept} & set(planned[0])
        if clash:  # the file holds requests written with this seed (an earlier --keep-prompts output)
            raise ValueError(f"{args.prompts}: holds {sorted(clash)[0]}, an id the requests of --seed {args.seed} take; give "
                             "another --seed, or a prompt file without these requests")  # fmt: skip
        base = load_base(args.model, recorded_quantization(work, args.quantization), args.dtype, args.device)
        check_base_model(work, base)  # requests cached by another model are its text
        rows = generate_requests(base, prompts, work, params, planned)
    if not rows:
        raise ValueError(f"none of the {args.count} requests is worth training on: each was cut by --max-new-tokens "
                         f"{args.max_new_tokens}, ended before the model's own words, or repeated another; raise "
                         "--max-new-tokens or --count (with another --work: requests are kept with their settings)")  # fmt: skip
    write_atomic(out, "".join(json.dumps(row) + "\n" for row in kept + rows), shared=True)
    left = args.count - len(rows)
    print(f"{len(rows)} requests written to {out}" + (f" after its {len(kept)} own prompts" if kept else "")
          + (f" ({left} of {args.count} left out: cut by --max-new-tokens, without words of the model's own, shorter "
             f"than 3 words, or repeating another or a file prompt)" if left else "")
          + f"; train on them with train-head --prompts {out}"
          + ("" if kept else " (with held-out prompts beside them for held-out figures: --keep-prompts)"))  # fmt: skip
    return 0


def run_train_head(args) -> int:
    from core.prompt import PromptFileError
    from core.training.answers import training_ids
    from core.training.pipeline import ANSWERS_FILE
    from core.training.report import NOTES_FILE, REPORT_FILE
    from core.training.work import holds_a_run, not_a_work_folder
    from models.head import CONFIG_FILE, WEIGHT_FILES

    set_threads(args.threads)
    out = user_path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: is a file; name a folder for the head")
    if not training_ids(user_path(args.prompts)):  # every line checked before the model loads
        raise PromptFileError(f"{args.prompts}: no prompts")
    work = training_work(args)
    if work.exists() and not work.is_dir():
        raise ValueError(f"--work {work}: is a file; name a folder for the run's work")
    if work.resolve() == out.resolve():  # the head among gigabytes of features, deleted with them
        raise ValueError(f"--work {args.work}: is the --out folder; give the run's work (answers, features, checkpoints) "
                         "a folder of its own, or leave --work out (OUT/work)")  # fmt: skip
    holder = held_by(work)
    if holder is not None:  # before what its work there looks like to this run
        raise ValueError(busy_text(work, holder, "train-head"))
    if stranger := not_a_work_folder(work):  # a run would answer afresh among its files, or take them for its own
        raise ValueError(f"{stranger}; give the --work of the run to resume, or a new folder (by default OUT/work)")
    earlier_run = holds_a_run(work)
    if earlier_run and not args.resume:
        raise ValueError(earlier_run_text(work))
    # what the run writes into --out: an earlier run's (resumed) or someone's own files are not replaced unasked
    holds_head = any((out / name).exists() for name in (CONFIG_FILE, *WEIGHT_FILES, REPORT_FILE, NOTES_FILE))
    if args.init_head:
        check_head_folder(args.init_head, "--init-head")
        if user_path(args.init_head).resolve() == out.resolve():
            raise ValueError(f"--out {args.out}: is the --init-head folder; write the new head to another folder")
        check_initial_head(args.init_head, args.arch)
    if holds_head and not args.resume:
        raise ValueError(f"--out {args.out}: already holds a head or its notes ({CONFIG_FILE}, {REPORT_FILE}, {NOTES_FILE}), "
                         "which this run would replace; choose another folder")  # fmt: skip
    made = earlier_arch(out)
    if holds_head and made not in (None, args.arch):
        raise ValueError(f"--out {args.out}: holds an {made} head; this --arch {args.arch} run would replace it: "
                         "give it another --out (and --work, or the same one to reuse its answers)")  # fmt: skip
    if holds_head and not earlier_run:  # --resume with nothing to resume: the head there is someone's, not this run's
        raise ValueError(f"--out {args.out}: already holds a head or its notes, and {work} holds no earlier run for "
                         "--resume to continue; choose another --out (or the --work of the run that wrote it)")  # fmt: skip
    if holds_head and not written_by_run(out, work):  # another run's head, a downloaded one, or one of unknown origin
        raise ValueError(f"--out {args.out}: holds a head that the run in {work} did not write (or that records no run: "
                         "downloaded, or written by an earlier Kestrel), which --resume would replace; resume into that "
                         "run's own --out, or choose another --out")  # fmt: skip
    if args.resume and not earlier_run:  # a forgotten --work would otherwise answer every prompt again, unasked
        raise ValueError(f"--resume: {work} holds no earlier run to continue; give the --work of the run to resume, "
                         "or leave --resume out to start one")  # fmt: skip
    # now, not after hours of work; after the refusals above, which leave no folder behind
    check_writable(str(work / ANSWERS_FILE), "--work" if args.work else "--out")  # the option the user gave
    check_writable(str(out / "model.safetensors"), "--out")
    with working_in(work, "train-head"):
        if holds_a_run(work) and not args.resume:  # one that started since the check above, and has ended
            raise ValueError(earlier_run_text(work))
        return train_in(args, out, work)


NO_HEAD_YET = 75  # sysexits' EX_TEMPFAIL: nothing to use yet, --resume goes on; a script's `&&` stops here


def earlier_run_text(work: Path) -> str:
    return f"{work}: holds an earlier run; pass --resume to continue it, or choose another --out/--work"


def train_in(args, out: Path, work: Path) -> int:
    """run_train_head's run, once its options and folders are checked and `work` is held."""
    import time

    from core.training.answers import AnswerParams
    from core.training.features import FeatureParams, FeaturesStopped
    from core.training.pipeline import Budget, RunPaths, TrainingStopped, train_head
    from core.training.report import percent
    from core.training.trainer import TrainParams
    from models.base import load_base

    budget = Budget()
    if args.time_budget_minutes is not None:
        start = time.time()
        seconds = 60 * args.time_budget_minutes
        budget = Budget(answers_deadline=start + args.answer_share * seconds, train_deadline=start + seconds)
    paths = RunPaths(prompts=Path(args.prompts), out=out, work=work)
    answers = AnswerParams(args.samples_per_prompt, args.max_new_tokens, args.answer_temperature, args.answer_batch,
                           args.max_prompt_tokens, seed=args.seed)
    params = TrainParams(
        epochs=args.epochs, learning_rate=args.learning_rate, batch_tokens=args.batch_tokens,
        unroll_steps=args.unroll_steps, bf16=args.precision == "bf16", seed=args.seed, arch=args.arch,
        init_head=str(user_path(args.init_head).resolve()) if args.init_head else None,
    )  # fmt: skip
    quantization = recorded_quantization(work, args.quantization)
    base = load_base(args.model, quantization, args.dtype, args.device)
    try:
        report = train_head(base, paths, answers, FeatureParams(), params, budget, draft_vocab=args.draft_vocab or None)
    except (FeaturesStopped, TrainingStopped) as stop:  # no head yet: its training has not started
        print(f"stopped by the time budget ({stop}); no head was written; run again with --resume to continue ({work})")
        return NO_HEAD_YET
    training, data, final = report["training"], report["data"], report["final_eval"]
    if final["accuracy"]:
        held_out = (
            f"held-out top-1 {', '.join(percent(a) for a in final['accuracy'])} (draft steps 1..{len(final['accuracy'])}, "
            "the written head, judged as eval-heads judges it)"
        )  # fmt: skip
    elif data.get("eval_prompts"):  # held out, but the budget skipped their answers, or each is too short to judge
        held_out = f"no held-out figures (none of the {data['eval_prompts']} held-out prompts has an answer of 2 tokens or more here)"
    else:
        held_out = "no held-out figures (no prompt was held out)"
    print(f"head written to {out}: {training['steps']}/{training['total_steps']} steps, {held_out}")
    unanswered, planned = data.get("unanswered", 0), data.get("planned_answers", 0)
    if data.get("unplanned_answers"):
        print(f"note: this head also learned from {data['unplanned_answers']} answers to prompts or samples this run does not "
              f"plan (gone from the prompts file, or skipped there): their features in {work} were taken before (a new --work "
              "answers exactly this run's prompts)")  # fmt: skip
    if unanswered and data.get("features_kept"):
        print(f"note: {unanswered} of the {planned} answers this run plans were not made: the features in {work} were taken "
              f"from the answers made before, and --resume keeps them as they are (a new --work answers every prompt)")  # fmt: skip
    elif unanswered:
        print(f"note: the time budget stopped the answers at {planned - unanswered} of {planned}; this head learned from those "
              f"only, and --resume keeps them as they are, their features taken (a new --work answers every prompt)")  # fmt: skip
    if training["steps"] < training["total_steps"]:
        print(f"stopped by the time budget; run again with --resume to continue ({work})")
    return 0


def run_eval_heads(args) -> int:
    import json

    import torch

    from app.session import default_head, load_draft_head
    from app.store import write_atomic
    from core.training.compare import check_feature_shards, drafted_accuracy
    from core.training.report import percent
    from core.training.work import BASE_FILE
    from models.base import load_base
    from models.head import CONFIG_FILE, head_files, resolve_head_folder

    set_threads(args.threads)
    sources = list(dict.fromkeys(([args.head] if args.head else []) + args.heads))  # a head named twice is judged once
    if not sources and default_head(args.model) is not None:
        sources = [str(default_head(args.model))]  # the bundled head, as --head's help says
    if not sources:
        raise ValueError("name at least one head to judge (--head or HEAD ...)")
    features = user_path(args.features)
    if not features.is_dir():
        raise ValueError(f"--features {args.features}: {'is a file' if features.exists() else 'no such folder'}; give the "
                         "features folder of a train-head run (OUT/work/features, or OUT/work/features-eagle3)")  # fmt: skip
    work = features.resolve().parent  # its train-head run's, which records the base model (`--features .` has no parent of its own)
    reads = [("--features", features), ("the record of the base model beside --features", work / BASE_FILE), ("--model", args.model),
             *(("HEAD" if source in args.heads else "--head", source) for source in sources)]  # fmt: skip
    json_out = check_writable(args.json_out, "--json", reads) if args.json_out else None
    by_split = {split: sorted((features / split).glob("shard-*.safetensors")) for split in ("train", "eval")}
    shards = by_split[args.split]
    if not shards:
        other = next((split for split, found in by_split.items() if found), None)
        inner = [name for name in ("features-eagle3", "features") if (features / name).is_dir()]  # a work folder given
        outer = [name for name in ("features-eagle3", "features") if (features / "work" / name).is_dir()]  # train-head's --out
        split = next(features.glob("shard-*.safetensors"), None) is not None  # features/eval given
        head = (features / CONFIG_FILE).is_file()  # a head's folder (or a model's) given
        hint = (f"; it has {other} shards (--split {other})" if other else
                f"; it is a work folder: give --features {features / inner[0]}" if inner else
                f"; it is a train-head --out folder: give --features {features / 'work' / outer[0]}" if outer else
                f"; it holds the shards of one split: give the folder above it, --features {work}" if split else
                f"; it holds {CONFIG_FILE}: a head's (or a model's) folder, not features; name heads with --head or HEAD, "
                "and give --features the features folder of a train-head run (OUT/work/features)" if head else
                " (run train-head first)")  # fmt: skip
        raise ValueError(f"{Path(args.features) / args.split}: no feature shards{hint}")
    # resolved and checked now, once (a repo id is looked up on the hub): a missing or wrong folder fails
    # before the model loads and other heads are judged
    folders = {source: resolve_head_folder(str(source)) for source in sources}
    for folder in folders.values():
        head_files(folder)
    base = load_base(args.model, recorded_quantization(work, args.quantization), args.dtype, args.device)
    check_feature_shards(base, shards)  # before any head is judged: no figures are lost to a shard of another model
    results = {}
    try:
        for source in sources:
            head = load_draft_head(base, folders[source], torch.float32)
            figures = drafted_accuracy(base, head, shards, args.steps, progress=True, label=f"judging {source} ({args.split} split)")
            results[source] = figures
            chain = ", ".join(  # each step's share of the chains that reached it, with that count
                f"{percent(a)} of {int(n)}" for a, n in zip(figures["chain_accuracy"], figures["chain_positions"])
            )
            print(f"{source}: top-1 {', '.join(percent(a) for a in figures['accuracy'])}; chain {chain} ({int(figures['positions'])} positions)")
    finally:  # a head refused later (one that does not fit this model) keeps the figures of those judged before it
        if json_out and results:
            write_atomic(json_out, json.dumps(results, indent=1) + "\n", shared=True)
            if len(results) < len(sources):  # stopped: say which heads the file lacks
                missing = ", ".join(str(source) for source in sources if source not in results)
                print(f"wrote {args.json_out} with the {len(results)} of {len(sources)} heads judged before it stopped; not judged: {missing}", file=sys.stderr)
    return 0


def run_bench_command(args) -> int:
    """`launch.py bench`: load, run with a progress line, print the table, write JSON."""
    import json

    from core.prompt import load_prompts

    prompts = load_prompts(args.prompts, args.limit, args.per_source)  # before the engine's imports: a bad file fails at once

    from app.session import folder_sizes, load_draft_head, made_for, prepare_costs
    from app.store import write_atomic
    from core.bench import BenchCancelled, check_head_named, check_turn_names, format_table, head_of, parse_mode, run_bench
    from core.config import TreeParams
    from core.engine import Engine
    from models.head import check_fits_sizes, local_head_folder

    check_turn_names(prompts, args.turns)  # said before the model loads
    modes = bench_modes(args.modes)
    others = {}
    for option in args.other_head:
        name, _, source = option.partition("=")
        if not name or not source or not name.isidentifier():
            raise ValueError(f"--other-head {option!r}: write NAME=HEAD, NAME a plain word (modes eagle2@NAME)")
        if name in others:
            raise ValueError(f"--other-head names {name} twice ({others[name]} and {source})")
        others[name] = source
    for mode in modes:
        parse_mode(mode, TreeParams())  # a mode that takes no head is said as such, before any head's name
        check_head_named(mode, others)
    drafting = {head_of(mode) for mode in modes}
    unused = [name for name in others if name not in drafting]
    if unused:  # it would load, compile and measure its costs for nothing
        raise ValueError(f"--other-head {unused[0]}: no mode drafts with it; add eagle2@{unused[0]} to --modes")
    for source in others.values():
        folder = local_head_folder(source)  # a missing folder fails now, not after the model has loaded
        if folder is not None:  # ... and one that holds no head, or unreadable weights, or a head for another model: as --head
            with made_for(folder, args.model):
                check_fits_sizes(folder, *folder_sizes(args.model))
    reads = [("--prompts", args.prompts), ("--model", args.model), ("--head", args.head), ("--llama-python", args.llama_python),
             *((f"--other-head {name}", source) for name, source in others.items())]  # fmt: skip
    json_out = check_writable(args.json_out, "--json", reads) if args.json_out else None
    sampling, tree = sampling_from(args), tree_from(args)  # a bad value fails before the model loads
    check_distinct(modes, tree)
    if "llama.cpp" in modes and not args.llama_python:
        raise ValueError("mode llama.cpp needs --llama-python: a Python with llama-cpp-python installed")
    if "llama.cpp" in modes and not sampling.greedy:
        raise ValueError("mode llama.cpp is measured greedy only; use --temperature 0")
    if "llama.cpp" in modes and shutil.which(str(user_path(args.llama_python))) is None:
        raise ValueError(f"--llama-python {args.llama_python}: no such program")
    drafted = [(head_of(mode), *parse_mode(mode, tree)) for mode in modes]
    own_head = any(head is None and mode in ("eagle", "eagle2") for head, mode, _ in drafted)  # else no head is loaded
    planned = {head for head, mode, shape in drafted if mode == "eagle2" and shape.planned}  # the heads whose trees the costs size
    if own_head and not args.head:
        from app.session import check_source, default_head

        check_source(args.model)  # a mistyped path is said as one, not as a base without a head
        if default_head(args.model) is None:  # said before a model loads for minutes, as chat says it
            needing = ", ".join(sorted({mode for head, mode, _ in drafted if head is None and mode in ("eagle", "eagle2")}))
            raise ValueError(f"--modes {needing} needs a draft head: give --head HEAD (a head trained for this model), or leave {needing} out")
    engine = load_engine(args, with_head=own_head)
    other_heads = {
        name: Engine(engine.base, load_draft_head(engine.base, source), source, args.compile) for name, source in others.items()
    }
    for name, chosen in [(None, engine), *other_heads.items()]:
        if (args.calibrate and chosen.head is not None) or name in planned:
            prepare_costs(chosen, args.calibrate)

    def show(done: int, total: int, description: str) -> None:  # on the terminal only: a saved table stays clean
        print(f"\r[{done}/{total}] {description:<50}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    written = []  # whether an earlier write of this run reached the file

    def write(result: dict) -> None:  # whole, or not at all: a file cut mid-write would lose the earlier prompts too
        try:
            write_atomic(json_out, json.dumps(result, indent=1), shared=True)
        except OSError as error:  # a full disk: say what the file holds, as an interrupt does
            held = ("it holds this run's results as of an earlier prompt (\"complete\": false)" if written else
                    "no result of this run is there")  # fmt: skip
            raise OSError(f"{args.json_out}: cannot be written ({error.strerror or error}); {held}") from error
        written.append(True)

    with stop_on_interrupt() as stop:
        try:
            result = run_bench(
                engine, prompts, modes, sampling, tree, args.warmup, show if sys.stderr.isatty() else None,
                str(user_path(args.llama_python)) if args.llama_python else None,  # as checked above: ~ expanded
                other_heads, partial=write if json_out else None, cancel=stop, turns=args.turns,
            )  # fmt: skip
        except BenchCancelled as stopped:
            if stopped.result is not None:  # the prompts finished before Ctrl+C
                print(format_table(stopped.result))
                if json_out:
                    write(stopped.result)
                    print(f"wrote {args.json_out} (the prompts finished before the interrupt)")
            elif json_out and json_out.exists():  # not this run's: say so, rather than leave it to pass for one
                print(f"no prompt finished; {args.json_out} was not written (the file there is an earlier run's)")
            raise KeyboardInterrupt from None
    print(format_table(result))
    if json_out:
        write(result)
        print(f"wrote {args.json_out}")
    return 0


def run_app_bench_command(args) -> int:
    import json

    from app.appbench import format_rows, run_app_bench
    from app.store import write_atomic
    from core.config import MODES

    modes = list(bench_modes(args.modes))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:  # the page and `chat --mode` decode in these alone (bench's baselines and tree shapes are bench's own)
        raise ValueError(f"--modes {', '.join(unknown)}: bench-app measures {', '.join(MODES)}")
    if not (Path(args.root) / "launch.py").is_file():
        raise ValueError(f"--root {args.root}: no launch.py there; give the folder of the Kestrel to measure")
    json_out = check_writable(args.json_out, "--json") if args.json_out else None
    check_text(args.prompt, "--prompt")
    if not args.prompt.strip():  # refused here, not by the chat command it starts a model for
        raise ValueError("--prompt is empty: give the user message to measure")
    written = []  # the rows the file holds

    def write(rows: list[dict]) -> None:  # after each row, whole: a later way's failure or Ctrl+C keeps those measured
        write_atomic(json_out, json.dumps(rows, indent=1), shared=True)
        written[:] = rows

    try:
        rows = run_app_bench(
            args.prompt, modes, args.max_new_tokens, args.threads, args.port, Path(args.root), args.rounds,
            show=lambda what: print(f"measuring: {what}", flush=True), partial=write if json_out else None,
        )  # fmt: skip
    except BaseException:  # an error, Ctrl+C or SIGTERM: say what the file holds
        if written:
            print(f"wrote {args.json_out} with the {len(written)} rows measured before it stopped", file=sys.stderr, flush=True)
        raise
    print(format_rows(rows))
    if json_out:
        write(rows)
        print(f"wrote {args.json_out}")
    return 0
