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

