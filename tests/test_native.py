"""Kestrel's C++ kernels in their AVX2 forms, tested on AVX-512 machines too.

Built with -march=native, the int4, int8 and attention kernels take their
AVX-512 forms where the CPU has it, so on such a machine the rest of the
suite never runs the AVX2 forms that other CPUs build. Here they are built
with -march=haswell (AVX2 and FMA, no AVX-512) and put through the same
kernel tests, in a fresh process (a process holds one build of each)."""

import subprocess
import sys
from pathlib import Path

import pytest

from core import native

ROOT = Path(__file__).resolve().parent.parent

AVX2_RUN = """
import sys
from core import native, rowkernel
from models import int4, int8

native.FLAGS = ["-march=haswell" if flag == "-march=native" else flag for flag in native.FLAGS]
assert "-march=haswell" in native.FLAGS
built = {"int4": int4.own_kernel(), "int8": int8.own_kernel(), "rows": rowkernel.library() is not None}
if not all(built.values()):
    sys.exit(f"AVX2 builds failed: {built}")
import pytest

sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", *sys.argv[1:]]))
"""


def avx512_machine() -> bool:
    return "avx512f" in native.cpu_flags().split()


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
@pytest.mark.skipif(not avx512_machine(), reason="without AVX-512 the suite already runs the AVX2 builds")
def test_the_avx2_builds_of_the_kernels_pass_the_kernel_tests():
    tests = ["tests/test_int8.py", "tests/test_argmax.py", "tests/test_rowkernel.py"]
    result = subprocess.run(
        [sys.executable, "-c", AVX2_RUN, *tests], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.parametrize("platform", ["win32", "darwin"])
def test_kernels_and_compiling_are_not_tried_off_linux(monkeypatch, platform):
    """No build attempt on Windows (torch.compile wants MSVC, a MinGW g++
    cannot link against torch) or macOS (g++ may be a stub that asks to
    install the developer tools): the same model runs eagerly there."""
    from core import compiled

    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")  # a compiler on the PATH (or a stub)
    monkeypatch.setattr(sys, "platform", platform)
    assert native.compiler() is None and not compiled.compiler_available()
    assert native.build("probe", "int x;", [], "a probe") is None


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
def test_a_damaged_cached_kernel_is_built_again(tmp_path, monkeypatch):
    """A cached library cut short (a power cut while it was written) would kill
    the process when loaded (SIGBUS): it is found by its ELF header and built
    again; an empty one too."""
    monkeypatch.setattr(native, "cache_root", lambda: tmp_path)
    source = "extern \"C\" int kestrel_answer() { return 42; }\n"
    path = native.build("probe", source, ["-shared", "-fPIC", "-O1"], "a test")
    assert path is not None and native.intact(path)
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b""):
        path.write_bytes(damaged)
        assert not native.intact(path)
        assert native.build("probe", source, ["-shared", "-fPIC", "-O1"], "a test") == path
        assert path.read_bytes() == whole or native.intact(path)



@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
def test_a_kernel_that_does_not_build_is_not_tried_again_at_every_start(tmp_path, monkeypatch, caplog):
    """A build the compiler refuses is recorded beside the cache with its
    error (one line of it said) and skipped at later starts, until the
    compiler changes; a working build is cached as before."""
    import logging

    monkeypatch.setattr(native, "cache_root", lambda: tmp_path)
    runs = []
    real_run = subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    broken = '#error "this CPU cannot take it"\n'
    with caplog.at_level(logging.INFO, logger="kestrel"):
        assert native.build("probe", broken, ["-shared", "-fPIC"], "a test kernel") is None
    assert len(runs) == 1 and "building its kernel failed" in caplog.text and "this CPU cannot take it" in caplog.text
    assert len(max(caplog.text.splitlines(), key=len)) < 400  # not the compiler's whole command line
    record = next(tmp_path.glob("kernels/probe-*.failed.txt"))
    assert "this CPU cannot take it" in record.read_text()
    native._said.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kestrel"):
        assert native.build("probe", broken, ["-shared", "-fPIC"], "a test kernel") is None
    assert len(runs) == 1 and f"did not build here (see {record})" in caplog.text  # not built again
    stamp = record.read_text().split("\n", 1)
    record.write_text("/usr/bin/another-g++ 1\n" + stamp[1])  # the compiler changed: tried again
    assert native.build("probe", broken, ["-shared", "-fPIC"], "a test kernel") is None and len(runs) == 2
    assert native.build("probe", "int x;\n", ["-shared", "-fPIC"], "a test kernel") is not None and len(runs) == 3


def test_kernels_are_not_built_for_cpus_they_cannot_run_on(monkeypatch, caplog):
    """x86-64 code with AVX2 and FMA: elsewhere no build is tried, and one line says so once."""
    import logging

    monkeypatch.setattr(native, "compiler", lambda: "/usr/bin/g++")
    said = set(native._said)
    native._said.clear()
    try:
        monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
        assert native.unsupported() == "they need an x86-64 CPU with AVX2 (this one is aarch64)"
        with caplog.at_level(logging.INFO, logger="kestrel"):
            assert native.build("probe", "int x;", [], "a probe") is None
            assert native.build("other", "int y;", [], "another") is None
        assert caplog.text.count("Kestrel's own kernels are off (they need an x86-64 CPU with AVX2") == 1
        monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(native, "cpu_flags", lambda: "flags fpu sse2 avx")
        assert native.unsupported() == "they need a CPU with AVX2 and FMA" or not Path("/proc/cpuinfo").is_file()
        monkeypatch.setattr(native, "compiler", lambda: None)
        assert native.unsupported() == "no C++ compiler (g++ or clang++) found"
    finally:
        native._said.clear()
        native._said.update(said)


def failing_builds(tmp_path, monkeypatch, returncode: int, said: str) -> list:
    """Builds whose compiler fails with `returncode`, saying `said` (on stderr); the list of their commands."""
    monkeypatch.setattr(native, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(native, "unsupported", lambda: None)
    monkeypatch.setattr(native, "compiler", lambda: "/usr/bin/g++")
    runs = []

    def failing(command, **kwargs):
        runs.append(command)
        raise subprocess.CalledProcessError(returncode, command, "", said)

    monkeypatch.setattr(native.subprocess, "run", failing)
    return runs


@pytest.mark.parametrize(
    ("returncode", "said"),
    [
        (1, "probe.cpp: fatal error: error writing to /tmp/ccx.s: No space left on device"),  # TMPDIR full
        (1, "g++: fatal error: Killed signal terminated program cc1plus"),  # the OOM killer, on the compiler proper
        (-9, ""),  # the OOM killer, on g++ itself
    ],
)
def test_a_build_stopped_by_the_machine_is_tried_again_at_the_next_start(tmp_path, monkeypatch, caplog, returncode, said):
    """A full disk or temporary folder, or a compiler killed for memory, says
    nothing about the kernel: no failure is recorded, the warning says the
    build is tried again, and the next start builds it."""
    import logging

    runs = failing_builds(tmp_path, monkeypatch, returncode, said)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        assert native.build("probe", "int x;\n", ["-shared"], "a test kernel") is None
    assert "building its kernel failed" in caplog.text and "tried again at the next start" in caplog.text
    assert not list(tmp_path.glob("kernels/*.failed.txt"))
    assert native.build("probe", "int x;\n", ["-shared"], "a test kernel") is None and len(runs) == 2


def test_a_recorded_failure_that_the_machine_caused_does_not_hold(tmp_path, monkeypatch):
    """A record written for a full disk (before such failures were told apart
    from the compiler's refusals) does not keep the kernel off: it is built again."""
    runs = failing_builds(tmp_path, monkeypatch, 1, "probe.cpp:1:2: error: #error \"no\"")
    assert native.build("probe", "int x;\n", ["-shared"], "a test kernel") is None
    record = next(tmp_path.glob("kernels/probe-*.failed.txt"))
    assert native.build("probe", "int x;\n", ["-shared"], "a test kernel") is None and len(runs) == 1  # refused: not again
    record.write_text(record.read_text().replace('error: #error "no"', "fatal error: error writing to /tmp/ccx.s: No space left on device"))
    assert native.build("probe", "int x;\n", ["-shared"], "a test kernel") is None and len(runs) == 2
