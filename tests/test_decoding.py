"""Decodings run on the thread that serves them (the main thread under
`launch.py ui`), in their turn, and nothing queued there is lost."""

import threading
import time

import pytest

from app.decoding import Decoding, MainThread, ServerStopping
from app.runtime import ModelQueue


def serving(runner: MainThread) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=runner.serve, args=(lambda: not stop.is_set(),), name="serving")
    thread.start()
    while not runner._serving:
        time.sleep(0.001)
    return thread, stop


def test_jobs_run_inline_when_nothing_serves():
    ran_on = []
    MainThread().run(lambda: ran_on.append(threading.current_thread().name))
    assert ran_on == [threading.current_thread().name]


def test_jobs_run_on_the_serving_thread_and_their_errors_come_back():
    runner = MainThread()
    thread, stop = serving(runner)
    try:
        ran_on = []
        runner.run(lambda: ran_on.append(threading.current_thread().name))
        assert ran_on == ["serving"]
        with pytest.raises(ValueError, match="bad step"):
            runner.run(lambda: (_ for _ in ()).throw(ValueError("bad step")))
        runner.run(lambda: ran_on.append("after"))  # an error does not stop serving
        assert ran_on == ["serving", "after"]
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_a_job_still_queued_when_serving_stops_fails_instead_of_waiting_forever():
    runner = MainThread()
    thread, stop = serving(runner)
    release, outcome = threading.Event(), []
    first = threading.Thread(target=runner.run, args=(release.wait,))
    first.start()

    def second():
        try:
            runner.run(lambda: outcome.append("ran"))
        except ServerStopping as error:
            outcome.append(str(error))

    waiting = threading.Thread(target=second)
    waiting.start()
    while runner._jobs.qsize() < 1:  # the second job waits behind the first
        time.sleep(0.001)
    stop.set()
    release.set()
    for worker in (first, waiting, thread):
        worker.join(5)
    assert outcome == ["the server is stopping"]


def test_a_decoding_streams_its_steps_from_the_serving_thread(monkeypatch):
    runner = MainThread()
    monkeypatch.setattr("app.decoding.MAIN_THREAD", runner)
    thread, stop = serving(runner)
    try:
        decoding = Decoding(ModelQueue(), lambda cancel: iter([threading.current_thread().name] * 3))
        decoding.join(5)
        assert decoding.read(0) == ["serving"] * 3 and decoding.finished
    finally:
        stop.set()
        thread.join(5)


def test_a_decoding_still_running_at_exit_is_ended_and_the_process_exits_cleanly(tmp_path):
    """A decoding thread left inside a torch call while Python shuts down
    aborted the process (SIGABRT, exit code 134) instead of letting it exit:
    the decodings still running are cancelled and waited for at exit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_mid_decoding.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "import torch\n"
        "from app.decoding import Decoding\n"
        "from app.runtime import ModelQueue\n"
        "x = torch.randn(256, 256)\n"
        "def steps(cancel):\n"
        "    while not cancel.is_set():\n"
        "        for _ in range(20):\n"
        "            torch.sin(x @ x)\n"
        "        yield None\n"
        "decodings = [Decoding(ModelQueue(), steps) for _ in range(2)]\n"
        "time.sleep(0.3)\n"
        "assert not any(d.finished for d in decodings)\n"
        "print('exiting')\n"
    )
    for _ in range(2):  # without the exit hook, every run here aborted
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert done.returncode == 0 and "exiting" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_request_that_comes_after_serving_stopped_fails_instead_of_running():
    """After Ctrl+C a request that was waiting for the model got its turn and
    decoded inline (53 steps in 3 s) while the server shut down, and a page
    reply saved as waiting was overwritten as an interrupted one."""
    runner = MainThread()
    thread, stop = serving(runner)
    stop.set()
    thread.join(5)
    ran = []
    with pytest.raises(ServerStopping, match="the server is stopping"):
        runner.run(lambda: ran.append(1))
    assert ran == []
    MainThread().run(lambda: ran.append(2))  # a process that never served (the CLI, the tests) runs jobs inline
    assert ran == [2]


def test_a_failed_decoding_keeps_nothing_its_steps_held(monkeypatch):
    """The error a decoding ends with is kept for its reader; its traceback's
    frames held the model and the failed run's caches, which reference
    counting never freed (a cycle through the decoding's own frame): an
    Unload's or an out-of-memory error's memory stayed taken until a garbage
    collection, if one ever came."""
    import gc
    import weakref

    monkeypatch.setattr("app.decoding.MAIN_THREAD", MainThread())

    class Caches:  # what a run holds
        pass

    held = []

    def steps(cancel, model=Caches()):
        caches = Caches()
        held.extend([weakref.ref(model), weakref.ref(caches)])
        yield "first"
        try:
            raise RuntimeError("out of memory")
        except RuntimeError as error:
            raise ValueError("the reply failed") from error

    def request():
        model = Caches()
        decoding = Decoding(ModelQueue(), lambda cancel: steps(cancel, model))
        decoding.join(5)
        with pytest.raises(ValueError, match="the reply failed"):
            decoding.read(1)
        assert decoding.read(0) == ["first"] and decoding.read(1) == [] and decoding.done_reading(1)

    def request_left():  # its reader gone before the error came (a client that disconnected)
        model = Caches()
        Decoding(ModelQueue(), lambda cancel: steps(cancel, model)).join(5)

    gc.disable()
    try:
        request()
        assert [ref() for ref in held] == [None, None]
        held.clear()
        request_left()
        assert [ref() for ref in held] == [None, None]
    finally:
        gc.enable()
