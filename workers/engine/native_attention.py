"""The native paged-decode kernel (``paged_decode.c``): built on first use, loaded with ctypes.

The C file is compiled with the system C compiler into a per-user cache
(``$XDG_CACHE_HOME/disagg/kernels``, else ``~/.cache/disagg/kernels``),
named by a digest of the source, the flags and the CPU (``-march=native``
code must not run on another CPU model sharing the home directory), so an
engine compiles it once per machine type and later engines only load it
(~0.15 s to build here). Built in a temporary file and renamed into place:
engines starting together may each build it, never read a half-written one.

Only for float32 on the CPU. ``load_kernel`` returns None, and logs why,
when there is no compiler, the build fails or the built kernel disagrees
with the torch path on a probe; the engine then gathers KV and calls SDPA.

The kernel's instruction set follows torch's: ``-march=native``, less the
extensions torch was limited away from (``ATEN_CPU_CAPABILITY=avx2`` on an
AVX-512 CPU builds an AVX2 kernel, as an AVX2-only CPU would), so one
variable emulates an older x86 CPU for the whole engine
(``benchmarks/engine_throughput.py --emulate-isa avx2``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DecodeBatch", "NativeDecodeKernel", "build_flags", "build_library", "kernel_supports", "load_kernel"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# The kernel is written in vectors (GCC vector extensions), so it needs no math-relaxing flags; and
# never -ffast-math: gcc links crtfastmath.o into shared objects with it, which sets flush-to-zero
# for the whole process at load.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# What -march=native must give up when torch runs below the CPU's best (its capability names, x86).
_CAPABILITY_LIMITS = {"AVX2": ("-mno-avx512f",), "DEFAULT": ("-mno-avx",)}
BUILD_TIMEOUT_SECONDS = 120
LANES = 16  # paged_decode.c's widest vector (8 on AVX2): shapes are whole runs at either width

# Tensors pass as their data pointers (float32 or int64 as the C signature says; checked in __call__).
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = (
    _PTR, _I64,  # query, its row stride
    _PTR, _I64,  # out, its row stride
    _PTR,  # rows
    _PTR, _PTR,  # key cache, value cache
    _PTR, _I64,  # block tables, their row stride
    _PTR,  # context lengths
    _I64, _I64, _I64, _I64, _I64,  # decodes, heads, kv heads, head dim, block size
    ctypes.c_float,  # scale
)


def kernel_supports(head_dim: int, block_size: int) -> bool:
    """The kernel works on runs of 8 or 16 keys within one block, as many floats of a head at a time."""
    return head_dim % LANES == 0 and block_size % LANES == 0


@dataclass(frozen=True)
class DecodeBatch:
    """Every decode of a step, as the kernel reads them (one query token each)."""

    rows: torch.Tensor  # (B,) int64: the decodes' rows in the step's flattened tokens
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0 past each table
    context_lens: torch.Tensor  # (B,) int64: keys each decode attends, its own included

    @classmethod
    def build(cls, rows: list[int], tables: list[list[int]], context_lens: list[int]) -> DecodeBatch:
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        return cls(
            rows=torch.tensor(rows, dtype=torch.long),
            block_tables=torch.tensor(padded, dtype=torch.long),
            context_lens=torch.tensor(context_lens, dtype=torch.long),
        )


class NativeDecodeKernel:
    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path  # the built shared object, for the engine's log
        self._function = library.paged_decode_attention
        self._function.argtypes = _ARGTYPES
        self._function.restype = ctypes.c_int

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DecodeBatch,
        out: torch.Tensor,
    ) -> None:
        """Write the attention of ``batch``'s rows of query (N, H, D) over the pool
        (NB, BS, KVH, D) into the same rows of ``out`` (N, H, D)."""
        for name, tensor in (("query", query), ("out", out)):
            if tensor.dtype != torch.float32 or tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
                raise ValueError(f"{name} must be float32 with contiguous heads, got {tensor.dtype} {tensor.stride()}")
        for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
            if tensor.dtype != torch.float32 or not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous float32")
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        num_heads = query.shape[1]
        failed = self._function(
            query.data_ptr(), query.stride(0),
            out.data_ptr(), out.stride(0),
            batch.rows.data_ptr(),
            key_cache.data_ptr(), value_cache.data_ptr(),
            batch.block_tables.data_ptr(), batch.block_tables.stride(0),
            batch.context_lens.data_ptr(),
            batch.rows.shape[0], num_heads, num_kv_heads, head_dim, block_size,
            head_dim ** -0.5,
        )
        if failed:
            raise MemoryError("paged decode attention could not allocate its scratch")


@functools.cache
def load_kernel() -> NativeDecodeKernel | None:
    """The kernel, built if needed; None (logged) when it cannot be built or fails its probe."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc or gcc) on PATH: decode attention gathers KV for SDPA instead")
        return None
    try:
        path = _build(compiler)
        kernel = NativeDecodeKernel(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # RuntimeError: no home directory
        log.warning("native paged-decode kernel unavailable (%s): decode attention gathers KV for SDPA", exc)
        return None
    if not _probe(kernel):
        log.warning("native paged-decode kernel disagrees with SDPA on its probe: not used")
        return None
    return kernel


def build_flags() -> tuple[str, ...]:
    """FLAGS, limited to the instruction set torch's own kernels run with (the cache key has them)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return FLAGS
    return FLAGS + _CAPABILITY_LIMITS.get(torch.backends.cpu.get_cpu_capability(), ())


def _build(compiler: str) -> Path:
    return build_library(compiler, SOURCE)


def build_library(compiler: str, source_path: Path) -> Path:
    """``source_path`` (a C file of this package) built into the kernel cache, or found there built."""
    source = source_path.read_bytes()
    flags = build_flags()
    digest = hashlib.sha256(source + " ".join(flags).encode() + _cpu_identity().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, str(source_path), "-o", partial],
            capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} exited {result.returncode}: {result.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disagg" / "kernels"


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU model and its feature flags."""
    identity = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("model name", "flags")):
                    identity.append(line.strip())
                if len(identity) == 3:
                    break
    except OSError:
        pass
    return "\n".join(identity)


def _probe(kernel: NativeDecodeKernel) -> bool:
    """Three decodes over a small shuffled pool, against gather + SDPA: lengths
    that end inside a run of 16 keys, on a block boundary and past one."""
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, group, head_dim = 12, 32, 2, 3, 32
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(4, num_kv_heads * group, head_dim, generator=generator)
    tables, lengths, rows = [[7, 2, 9], [0], [5, 11]], [75, 1, 64], [3, 0, 2]
    out = torch.zeros_like(query)
    kernel(query, key_cache, value_cache, DecodeBatch.build(rows, tables, lengths), out)
    for row, table, length in zip(rows, tables, lengths):
        keys = key_cache[table].flatten(0, 1)[:length].transpose(0, 1)  # (KVH, L, D)
        values = value_cache[table].flatten(0, 1)[:length].transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[row].unsqueeze(1), keys, values, enable_gqa=True
        ).squeeze(1)  # (H, D)
        if not torch.allclose(out[row], expected, rtol=1e-4, atol=1e-5):
            return False
    return True
