"""llama.cpp as a measuring stick for `bench --modes ...,llama.cpp`.

Runs under another Python that has llama-cpp-python (it is not a dependency
of Kestrel: `python3 -m venv DIR && DIR/bin/pip install llama-cpp-python`
builds it), given with `--llama-python DIR/bin/python`. It imports nothing
from Kestrel. Protocol: argv = GGUF path, threads, context window; then one JSON request per
stdin line ({"ids": prompt token ids, "max_new_tokens", "stop": token ids}),
one JSON answer per stdout line ({"ids": generated ids, "seconds"}). Greedy
only: each prompt is evaluated from scratch (no cache reuse), timed from the
first prompt token to the last generated one, as Kestrel's modes are."""

from __future__ import annotations

import json
import signal
import sys
import time


def main() -> None:
    # a terminal's Ctrl+C reaches this process too: Kestrel stops the benchmark between rows,
    # and this helper ends when its input closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    path, threads = sys.argv[1], int(sys.argv[2])
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 4096  # Kestrel's context window for the model: its prompts fit
    try:
        from llama_cpp import Llama
    except ImportError as error:  # one line for Kestrel to show, not this Python's traceback
        print(json.dumps({"ready": False, "problem": f"llama-cpp-python is not installed there ({error})"}), flush=True)
        return
    try:
        model = Llama(model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
    except (ValueError, RuntimeError, OSError) as error:
        print(json.dumps({"ready": False, "problem": f"llama.cpp could not load {path} ({error})"}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        stop = set(request["stop"])
        model.reset()
        ids = []
        started = time.perf_counter()
        for token in model.generate(request["ids"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            ids.append(token)
            if token in stop or len(ids) >= request["max_new_tokens"]:
                break
        seconds = time.perf_counter() - started
        print(json.dumps({"ids": ids, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
