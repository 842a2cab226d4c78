"""The CPU's compiled kernels: packed-panel fp32 matmuls, paged decode attention, and
greedy choice under grammar masks.

Small C files ship in this package (``pool.c``: the work-sharing thread pool the
kernels run on; ``gemm.c``: matmuls over weights packed once into column panels;
``decode_attention.c``: one query row per sequence over its pages; ``token_mask.c``:
argmax over each row's allowed tokens). They are compiled on
first use with the system C compiler for the machine they run on (``-O3 -march=native``,
a second or two), into ``~/.cache/qworker/cpu_kernels`` (``$XDG_CACHE_HOME`` first)
under a hash of the sources, the flags and the CPU, and called through ``ctypes``
(which releases the GIL). Without a compiler, or if the build fails, ``load`` returns
None (logged once) and the engine keeps its torch forms: ``F.linear``
(``qworker.models.cpu_gemm``) and the batched torch decode
(``qworker.attention.cpu_backend``).

Measured on the 2-core machine of docs/benchmarks.md, SmolLM2-135M fp32: a 9-sequence
decode step's matmuls 2.6x faster than ``F.linear`` on one thread; see that file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = ("pool.c", "gemm.c", "decode_attention.c", "token_mask.c")
HEADERS = ("pool.h", "vec.h")
_DIR = Path(__file__).resolve().parent
_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread")
_LIB_NAME = "libqwcpu.so"

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_f32 = ctypes.c_float


class CpuKernels:
    """The loaded library; its functions take raw pointers (see the C files)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.qw_gemm_panel_width.restype = _i64
        lib.qw_gemm_panel_width.argtypes = []
        lib.qw_gemm_pack.restype = None
        lib.qw_gemm_pack.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
        lib.qw_gemm_parallel.restype = None
        lib.qw_gemm_parallel.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64]
        lib.qw_pool_set_threads.restype = _i64
        lib.qw_pool_set_threads.argtypes = [_i64]
        lib.qw_decode_attention.restype = None
        lib.qw_decode_attention.argtypes = [
            _ptr, _i64, _i64,  # q, row and head strides
            _ptr, _i64, _i64, _i64,  # k cache, block/head/token strides
            _ptr, _i64, _i64, _i64,  # v cache
            _ptr, _i64, _ptr,  # block tables, row stride, seq lens
            _i64, _i64, _i64, _i64, _i64, _i64,  # seqs, q heads, kv heads, dim, block, window
            _f32, _f32, _ptr, _i64, _i64,  # scale, soft-cap (0: none), out, row/head strides
        ]
        lib.qw_masked_argmax.restype = None
        lib.qw_masked_argmax.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        self.lib = lib
        self.path = path
        self.panel_width = int(lib.qw_gemm_panel_width())
        self.threads = 1

    def set_threads(self, threads: int) -> int:
        """Run each kernel on ``threads`` threads (the caller and ``threads - 1`` helpers
        sharing its chunks; see ``pool.c``); returns the number in use. Results do not
        depend on it."""
        self.threads = int(self.lib.qw_pool_set_threads(max(1, threads)))
        return self.threads


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's feature flags."""
    ident = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                ident += "|" + line
    except OSError:
        ident += "|" + platform.processor()
    return ident


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _build(cache_root: Path, march: str) -> Path:
    """Compile the library for ``-march=<march>`` into ``cache_root`` (reusing an earlier
    build); its path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = (*_FLAGS, f"-march={march}")
    digest = hashlib.sha256(" ".join(flags).encode() + _cpu_identity().encode())
    for name in (*HEADERS, *SOURCES):
        digest.update(name.encode() + (_DIR / name).read_bytes())
    folder = cache_root / digest.hexdigest()[:16]
    lib = folder / _LIB_NAME
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / _LIB_NAME
        proc = subprocess.run(
            [cc, *flags, "-o", str(built), *(str(_DIR / s) for s in SOURCES), "-lm"],
            capture_output=True, text=True, timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        built.replace(lib)  # atomic: a concurrent build just wins the same name
    return lib


_lock = threading.Lock()
_loaded: dict[tuple[Path, str], CpuKernels | None] = {}


def load(cache_root: Path | None = None, march: str = "native") -> CpuKernels | None:
    """The compiled kernels, built on first use; None if they cannot be built here (no
    compiler, a failed build: logged once, the engine keeps its torch forms).

    ``march``: the ``-march`` target (tests build the narrower vector paths with it).
    """
    if cache_root is None:
        from qworker.models.sources import default_cache_dir

        cache_root = default_cache_dir().parent / "cpu_kernels"
    root = cache_root
    with _lock:
        if (root, march) in _loaded:
            return _loaded[root, march]
        started = time.perf_counter()
        try:
            try:
                path = _build(root, march)
            except OSError:  # an unwritable cache: build in a private temporary folder
                path = _build(Path(tempfile.mkdtemp(prefix="qworker-cpu-kernels-")), march)
            kernels: CpuKernels | None = CpuKernels(path)
            logger.info("CPU kernels ready in %.1fs (%s)", time.perf_counter() - started, path)
        except Exception as exc:
            logger.warning("CPU kernels unavailable, using torch's ops: %s", exc)
            kernels = None
        _loaded[root, march] = kernels
        return kernels
