"""Building Kestrel's small C++ kernels (core/rowkernel.py, models/int4.py, models/int8.py).

Each kernel is compiled once with the system's C++ compiler (the same one
torch.compile uses on CPUs) into Kestrel's cache folder, under a name that
hashes its source, flags, compiler and CPU (the binaries use -march=native,
so they are for this CPU only). A build writes a per-process file and renames
it, so concurrent processes never load a half-written library."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from models.bundled import cache_root

log = logging.getLogger("kestrel")

# -ffp-contract=off: no fused multiply-adds chosen by the compiler here and not there
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
# What GCC, clang and ld say when the machine stopped a build, not the source: a full disk or
# temporary folder, too little memory, a compiler or linker killed (by the OOM killer, say).
PASSING_FAILURES = ("no space left", "disk quota exceeded", "cannot create temporary file", "out of memory",
                    "cannot allocate memory", "memory exhausted", "resource temporarily unavailable",
                    "signal terminated program", "terminated with signal", "due to signal", "unable to execute command")  # fmt: skip


# What the int4 and int8 product kernels share (prepended to their sources): the float vector
# they accumulate in (16 lanes with AVX-512, else 8: the two builds round differently, each the
# same way for every row), its fixed-order lane sum, and the walk over an output in blocks of C
# columns x RB rows. A kernel passes run(C, RB, n, r) computing one block; every element gets the
# same operations whatever the block, so the blocks only decide how often the weights are read:
# once for all the rows of a pass of up to 7 (12 with AVX-512's 32 registers), else once per 4 (8).
BLOCKS = r"""
#include <cstdint>
#include <type_traits>
#ifndef __AVX2__
#error "Kestrel's product kernels need AVX2 and FMA"
#endif
#include <immintrin.h>

static inline float sum8(__m256 v) {  // fixed order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#ifdef __AVX512F__
typedef __m512 vec;
static constexpr int LANES = 16;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset1(float value) { return _mm512_set1_ps(value); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a, vec b) {  // of a + b, fixed order
    const __m512 v = _mm512_add_ps(a, b);
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
static inline vec vfrom_u8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }  // the first LANES bytes
static inline vec vfrom_i8(const int8_t* p) {  // LANES bytes at p
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else
typedef __m256 vec;
static constexpr int LANES = 8;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset1(float value) { return _mm256_set1_ps(value); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a, vec b) { return sum8(_mm256_add_ps(a, b)); }  // of a + b, fixed order
static inline vec vfrom_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }  // the first LANES bytes
static inline vec vfrom_i8(const int8_t* p) {  // LANES bytes at p
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// blocks of C columns x RB rows at row r, from column n while they fit before `end`; -> the next column
template <int C, int RB, typename Run>
static inline int64_t sweep(int64_t n, int64_t end, int64_t r, const Run& run) {
    for (; n + C <= end; n += C) run(std::integral_constant<int, C>{}, std::integral_constant<int, RB>{}, n, r);
    return n;
}

// every block of columns [begin, end) and rows [0, R)
template <typename Run>
static inline void each_block(int64_t R, int64_t begin, int64_t end, const Run& run) {
    int64_t r = 0;
#ifdef __AVX512F__
    for (; R - r > 12; r += 8) sweep<1, 8>(begin, end, r, run);
    switch (R - r) {
        case 8: sweep<1, 8>(begin, end, r, run); return;
        case 9: sweep<1, 9>(begin, end, r, run); return;
        case 10: sweep<1, 10>(begin, end, r, run); return;
        case 11: sweep<1, 11>(begin, end, r, run); return;
        case 12: sweep<1, 12>(begin, end, r, run); return;
        default: break;
    }
#else
    for (; R - r > 7; r += 4) sweep<1, 4>(begin, end, r, run);
#endif
    switch (R - r) {
        case 0: break;
        case 1: sweep<1, 1>(sweep<4, 1>(begin, end, r, run), end, r, run); break;
        case 2: sweep<1, 2>(sweep<2, 2>(begin, end, r, run), end, r, run); break;
        case 3: sweep<1, 3>(begin, end, r, run); break;
        case 4: sweep<1, 4>(begin, end, r, run); break;
        case 5: sweep<1, 5>(begin, end, r, run); break;
        case 6: sweep<1, 6>(begin, end, r, run); break;
        default: sweep<1, 7>(begin, end, r, run); break;
    }
}
"""


# What the AMX kernels share (prepended to the sources of models/int4.py, models/int8.py and
# core/rowkernel.py): KESTREL_TILES where the compiler targets AMX with bf16, the process's request
# for the tile state (Linux hands it out once asked: ARCH_REQ_XCOMP_PERM for XTILEDATA; the
# environment's KESTREL_AMX=0 declines it, so the vector kernels run instead) and a thread's tile
# configuration. A kernel built without KESTREL_TILES (where tiles_permitted() is false), or refused
# the state, uses its vector code, or where the compiler targets AVX512-BF16 (KESTREL_DOTS), the
# same tile layouts as vdpbf16ps chains.
TILES = r"""
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KESTREL_DOTS 1  // vdpbf16ps: pairs of bf16 products added to float32 lanes
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

// Groups of the tile layout ahead of the one in use that the vdpbf16ps products ask the caches for:
// the hardware prefetcher alone leaves their loads waiting. On the 2-core AVX-512 EPYC a step's int4
// products took 2.9 -> 2.4 ms for one row and 5.7 -> 4.3 for eight with it (4 and 8 groups ahead
// gained less), and the int8 lm_head screen of 8 rows after them 1.17 -> 1.02 ms (2 and 4 rows unchanged).
constexpr int64_t PREFETCH = 16;

static inline void prefetch_lines(const void* start, int lines) {  // `lines` cache lines of 64 bytes from `start`
    for (int line = 0; line < lines; ++line) _mm_prefetch((const char*)start + 64 * line, _MM_HINT_T0);
}

// R rows of 16 float32 accumulators in `storage`, 64-byte aligned
static inline float* row_accumulators(std::vector<float>& storage, int64_t R) {
    storage.resize(R * 16 + 16);
    return (float*)(((uintptr_t)storage.data() + 63) & ~(uintptr_t)63);
}
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KESTREL_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

static bool tiles_permitted() {
    static const bool granted = [] {
        const char* off = std::getenv("KESTREL_AMX");
        return !(off && std::string(off) == "0") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return granted;
}

// this thread's tiles: tile t gets rows[t] rows of 64 bytes (16 float32 or 32 bf16)
static inline void configure_tiles(std::initializer_list<int> rows) {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config;
    std::memset(&config, 0, sizeof config);
    config.palette = 1;
    int t = 0;
    for (int count : rows) {
        config.rows[t] = uint8_t(count);
        config.colsb[t++] = 64;
    }
    _tile_loadconfig(&config);
}
#else
static bool tiles_permitted() { return false; }
#endif
"""


def compiler() -> str | None:
    """The C++ compiler for Kestrel's kernels and for torch.compile on CPUs,
    used on Linux only: on Windows torch.compile wants MSVC and the kernels'
    flags are GCC's (a MinGW g++ cannot link against torch), and on macOS
    /usr/bin/g++ may be a stub that asks to install the developer tools at
    every start. Elsewhere the same model runs eagerly."""
    if not sys.platform.startswith("linux"):
        return None
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@functools.cache
def cpu_flags() -> str:
    """The CPU's model and instruction-set flags (Linux), else torch's capability."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return " ".join(sorted({line for line in lines if line.startswith(("flags", "model name", "Features"))}))
    except OSError:
        return str(torch.backends.cpu.get_cpu_capability())


def torch_flags() -> list[str]:
    """Flags to build against the installed torch (its headers, libraries and
    OpenMP runtime, so at::parallel_for shares torch's threads)."""
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-I{include}", f"-I{include / 'torch/csrc/api/include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-fopenmp", "-w",
            f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]  # fmt: skip


_said: set[str] = set()  # what this process has said about its kernels, once each


def say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info(message)


def unsupported() -> str | None:
    """Why Kestrel's kernels cannot be built here, or None: they are x86-64
    code that needs AVX2 and FMA, built with GCC's flags on Linux."""
    if compiler() is None:
        return "no C++ compiler (g++ or clang++) found" if sys.platform.startswith("linux") else "they are built on Linux only"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they need an x86-64 CPU with AVX2 (this one is {platform.machine()})"
    flags = set(cpu_flags().split())
    if Path("/proc/cpuinfo").is_file() and not {"avx2", "fma"} <= flags:
        return "they need a CPU with AVX2 and FMA"
    return None


def build(stem: str, source: str, flags: list[str], what: str) -> Path | None:
    """The shared library built from `source` (building it if not cached), or
    None where it cannot be built here (said once per process, in one line for
    all kernels) or its build failed. A build the compiler refused is recorded
    beside the cache with the compiler's error, and not tried again at every
    start until the compiler changes (the first line of the error is said,
    once); one stopped by the machine (a full disk, a killed compiler) is tried
    again at the next start."""
    why = unsupported()
    if why is not None:
        eager = ", and the model runs eagerly (install g++ for the fast path)" if compiler() is None and sys.platform.startswith("linux") else ""
        say_once("unsupported", f"Kestrel's own kernels are off ({why}): torch's run instead, slower{eager}")
        return None
    tool = compiler()
    digest = hashlib.sha256((source + " ".join(flags) + tool + torch.__version__ + cpu_flags()).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    path = folder / f"{stem}-{digest}.so"
    failed = folder / f"{stem}-{digest}.failed.txt"
    if path.is_file():
        if intact(path):
            return path
        log.warning(f"{what}: the cached kernel {path} is damaged (cut short); building it again")
        path.unlink(missing_ok=True)
    compiler_id = compiler_stamp(tool)
    record = failed.read_text(errors="replace") if failed.is_file() else ""
    # a record of a passing failure (written before they were told apart) does not hold either
    if record.startswith(compiler_id + "\n") and not passing_failure(record):
        say_once(f"failed-{stem}", f"{what}: its kernel did not build here (see {failed}); torch's kernel runs instead")
        return None
    log.info(f"Building the {stem} kernel (once; cached afterwards)...")
    code = folder / f"{stem}-{digest}.{os.getpid()}.cpp"  # per process: builds may race
    staging = code.with_suffix(".so")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        code.write_text(source)
        # the source comes first: with GNU ld, libraries must follow the objects that use them
        subprocess.run([tool, str(code), "-o", str(staging), *flags], check=True, capture_output=True, text=True, timeout=300)
        with open(staging, "rb") as built:  # on disk before it takes the cached name: a power cut cannot leave it half there
            os.fsync(built.fileno())
        staging.replace(path)  # atomic: another process never loads a half-written file
        return path
    except (OSError, subprocess.SubprocessError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip()
        errors = [line for line in detail.splitlines() if "error" in line.lower()] or detail.splitlines() or [type(error).__name__]
        refused = isinstance(error, subprocess.CalledProcessError) and not passing_failure(detail, error.returncode)
        if refused:  # the compiler refused it: not worth trying at every start
            try:
                failed.write_text(f"{compiler_id}\n{' '.join(map(str, error.cmd))}\n\n{detail}\n")
            except OSError:
                pass
        again = "" if refused else ", and the build is tried again at the next start"
        log.warning(f"{what}: building its kernel failed ({errors[0].strip()[:200]}); torch's kernel runs instead{again}")
        return None
    finally:
        code.unlink(missing_ok=True)
        staging.unlink(missing_ok=True)


def passing_failure(said: str, returncode: int = 1) -> bool:
    """Whether a failed compiler run says nothing about the source: killed by
    a signal (a negative returncode), or stopped by the disk or memory
    (PASSING_FAILURES in what it said)."""
    return returncode < 0 or any(words in said.lower() for words in PASSING_FAILURES)


def compiler_stamp(tool: str) -> str:
    """The compiler's path and modification time: a recorded failure holds while they do."""
    real = os.path.realpath(tool)
    try:
        return f"{real} {os.stat(real).st_mtime_ns}"
    except OSError:
        return real


def intact(path: Path) -> bool:
    """Whether a built library is whole: an ELF file ends with its section
    headers, so one cut short (a power cut while it was written) is shorter
    than its header says; loading such a file kills the process (SIGBUS)."""
    try:
        with open(path, "rb") as file:
            header = file.read(64)
        size = path.stat().st_size
    except OSError:
        return False
    if len(header) < 64 or header[:4] != b"\x7fELF":
        return False
    if header[4] != 2 or header[5] != 1:  # not 64-bit little-endian: no check made here
        return True
    section_headers = int.from_bytes(header[0x28:0x30], "little")
    entry, count = int.from_bytes(header[0x3A:0x3C], "little"), int.from_bytes(header[0x3C:0x3E], "little")
    return section_headers + entry * count <= size


def load_operator(stem: str, source: str, what: str) -> bool:
    """Build `source` against the installed torch (once, cached) and load it,
    registering the torch operators it defines; False (logged, naming `what`)
    where it cannot be built or loaded."""
    path = build(stem, source, [*FLAGS, "-std=c++17", *torch_flags()], what)
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        log.warning(f"{what}: loading its kernel failed ({type(error).__name__}: {error})")
        return False
    return True
