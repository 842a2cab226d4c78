"""The CPU's fp32 linear layers through ``cpu_gemm.c``: weights packed once into panels.

On the CPU a decode step's matmuls are skinny (a few rows of activations against every
weight) and the BLAS behind ``F.linear`` streams nn.Linear's row-major weights poorly
at that shape; packing each weight once into contiguous column panels and running a
small register-tiled kernel over them was 2.6x faster per decode step of SmolLM2-135M
and ~1.2x at prefill sizes on the 2-core machine of docs/benchmarks.md.

The C source ships in the package and is compiled on first use with the system C
compiler for the machine it runs on (``-O3 -march=native``, about a second), cached
under ``~/.cache/qworker/cpu_kernels`` (``$XDG_CACHE_HOME`` first) by a hash of the
source, the command and the CPU; ``ctypes`` calls it without the GIL. Without a
compiler, or if the build fails, ``load`` returns None (logged once) and the models
keep ``F.linear``.

``pack_model`` packs every fp32 ``nn.Linear``/``FusedLinear`` weight of a model on the
CPU and attaches the packed form to the weight tensor (``PACKED_ATTR``); ``ops.linear``
uses it. A weight no embedding shares is then released (only the packed copy stays),
so packing costs no memory beyond a tied LM head's second layout. Each output is one
fp32 sum over k in order, bias last (``cpu_gemm.c``); the engine's tests hold the
greedy tokens to transformers' (tests/engine/test_llm.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qworker.models.sources import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemm.c")
#: Attribute of a weight tensor holding its ``PackedWeight``.
PACKED_ATTR = "qw_packed"
_FLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread")
_LIB_NAME = "libqwgemm.so"

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class GemmLibrary:
    """The compiled kernel: ``pack`` a weight, ``gemm`` over packed panels."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.qw_gemm_panel_width.restype = _i64
        lib.qw_gemm_panel_width.argtypes = []
        lib.qw_gemm_pack.restype = None
        lib.qw_gemm_pack.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
        lib.qw_gemm_parallel.restype = None
        lib.qw_gemm_parallel.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64]
        lib.qw_gemm_set_threads.restype = _i64
        lib.qw_gemm_set_threads.argtypes = [_i64]
        self._lib = lib
        self.path = path
        self.panel_width = int(lib.qw_gemm_panel_width())
        self.threads = 1

    def set_threads(self, threads: int) -> int:
        """Run each matmul on ``threads`` threads (the caller and ``threads - 1`` helpers
        that share its panels; see ``cpu_gemm.c``); returns the number in use. Results
        do not depend on it. Not while a matmul runs."""
        self.threads = int(self._lib.qw_gemm_set_threads(max(1, threads)))
        return self.threads

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """Pack a CPU fp32 ``[N, K]`` weight (any row stride, unit column stride)."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"cannot pack a {weight.dtype} weight of shape "
                             f"{tuple(weight.shape)} on {weight.device}")
        w = weight if weight.stride(1) == 1 else weight.contiguous()
        n, k = w.shape
        panels = -(-n // self.panel_width)
        out = torch.empty(panels * k * self.panel_width, dtype=torch.float32)
        self._lib.qw_gemm_pack(w.data_ptr(), n, k, w.stride(0), out.data_ptr())
        return PackedWeight(self, out, n, k, panels)

    def gemm(self, packed: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor) -> None:
        """``out[M, N] = x[M, K] @ W^T + bias`` (x rows unit-strided, out contiguous); one
        caller at a time (the engine thread)."""
        self._lib.qw_gemm_parallel(x.data_ptr(), x.shape[0], x.stride(0),
                                   packed.panels.data_ptr(), packed.n, packed.k,
                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   out.stride(0))


@dataclass(slots=True)
class PackedWeight:
    """One weight ``[n, k]`` in ``num_panels`` column panels of ``library``'s width."""

    library: GemmLibrary
    panels: torch.Tensor
    n: int
    k: int
    num_panels: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` for fp32 ``x`` of shape ``[..., k]``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], self.n), dtype=torch.float32)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        if x2.shape[0]:
            self.library.gemm(self, x2, bias, out)
        return out.view(*lead, self.n)


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
    """Compile the kernel for ``-march=<march>`` into ``cache_root`` (reusing an earlier
    build); its path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = (*_FLAGS, f"-march={march}")
    text = SOURCE.read_bytes()
    key = hashlib.sha256(text + " ".join(flags).encode() + _cpu_identity().encode())
    folder = cache_root / key.hexdigest()[:16]
    lib = folder / _LIB_NAME
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / _LIB_NAME
        proc = subprocess.run([cc, *flags, "-o", str(built), str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, lib)  # atomic: a concurrent build just wins the same name
    return lib


_lock = threading.Lock()
_loaded: dict[tuple[Path, str], GemmLibrary | None] = {}


def load(cache_root: Path | None = None, march: str = "native") -> GemmLibrary | None:
    """The compiled kernel library, building it on first use; None if it cannot be built
    here (no compiler, a failed build: logged once, the models keep ``F.linear``).

    ``march``: the ``-march`` target (tests build the narrower vector paths with it).
    """
    root = cache_root or default_cache_dir().parent / "cpu_kernels"
    with _lock:
        if (root, march) in _loaded:
            return _loaded[root, march]
        started = time.perf_counter()
        try:
            try:
                path = _build(root, march)
            except OSError:  # an unwritable cache: build in a private temporary folder
                path = _build(Path(tempfile.mkdtemp(prefix="qworker-cpu-kernels-")), march)
            library: GemmLibrary | None = GemmLibrary(path)
            logger.info("CPU GEMM kernel ready in %.1fs (%s)", time.perf_counter() - started,
                        path)
        except Exception as exc:
            logger.warning("CPU GEMM kernel unavailable, using torch's matmul: %s", exc)
            library = None
        _loaded[root, march] = library
        return library


def packed_of(weight: torch.Tensor) -> PackedWeight | None:
    """The packed form attached to ``weight`` by ``pack_model``, if any."""
    return getattr(weight, PACKED_ATTR, None)


def pack_model(model: nn.Module, library: GemmLibrary) -> int:
    """Pack every fp32 CPU linear weight of ``model`` (``nn.Linear`` and modules with a
    2-D ``weight`` and ``out_features``, such as ``FusedLinear``); returns bytes packed.

    Weights an ``nn.Embedding`` shares (a tied LM head) keep their storage for the
    lookup; the others keep only the packed copy (their tensor becomes empty, so a
    stray ``F.linear`` on it fails loudly instead of computing with stale values).
    """
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or id(weight) in seen:
            continue
        if not (isinstance(module, nn.Linear) or hasattr(module, "out_features")):
            continue
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        seen.add(id(weight))
        packed = library.pack(weight.detach())
        setattr(weight, PACKED_ATTR, packed)
        total += packed.panels.numel() * 4
        if id(weight) not in shared:
            weight.data = weight.data.new_empty((0,))
    return total
