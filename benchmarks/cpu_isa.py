"""Which vector extensions a CPU benchmark runs with, and emulating an older x86 CPU on a newer one.

An AVX-512 machine runs as an AVX2-only one when every library picks its
kernels no higher than AVX2; each reads its own variable, once, when it
first runs (so they must be set before torch is imported: ``emulate``
re-executes the benchmark with them):
  - torch's own kernels (ATen): ``ATEN_CPU_CAPABILITY``;
  - oneDNN (the engine's packed linears): ``ONEDNN_MAX_CPU_ISA``, and its
    older name ``DNNL_MAX_CPU_ISA``;
  - MKL (``F.linear``'s sgemm, so transformers): ``MKL_ENABLE_INSTRUCTIONS``.
    On AMD CPUs MKL takes its AVX2 path whatever the CPU has (measured on
    an AVX-512 EPYC: same sgemm time with AVX2, AVX512 or SSE4_2 here,
    where oneDNN's AVX-512 kernels run twice as fast as its AVX2 ones);
  - the engine's native paged-decode kernel follows torch's capability
    (``workers.engine.native_attention.build_flags``).
What is in effect is read back, not assumed: ``vector_extensions`` asks
oneDNN and MKL in a child process with their verbose output on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

__all__ = ["EMULATIONS", "describe", "emulate", "vector_extensions"]

EMULATIONS: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "DNNL_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
_X86_EXTENSIONS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                   "amx_tile")

# One oneDNN linear and one MKL sgemm, with both libraries' verbose output on.
_PROBE = """
import torch
w = torch.randn(64, 64)
torch.ops.mkldnn._linear_pointwise(torch.randn(4, 64), torch.ops.mkldnn._reorder_linear_weight(w, None),
                                   None, "none", [], "")
torch.randn(4, 64) @ w
"""


def emulate(isa: str | None) -> None:
    """Re-execute this process with ``isa``'s variables set, unless they are set already."""
    if isa is None:
        return
    wanted = EMULATIONS[isa]
    if all(os.environ.get(name) == value for name, value in wanted.items()):
        return
    sys.stdout.flush()
    # orig_argv: the interpreter's own options and a -c or -m too, not only the script's arguments.
    os.execve(sys.executable, sys.orig_argv, {**os.environ, **wanted})


def vector_extensions() -> dict[str, object]:
    """The CPU's extensions, and those torch, oneDNN, MKL and the native kernel run with."""
    import torch

    from workers.engine.native_attention import build_flags

    result: dict[str, object] = {
        "cpu_model": _cpuinfo("model name"),
        "cpu_extensions": [e for e in _X86_EXTENSIONS if e in _cpuinfo("flags").split()],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": None,
        "mkl_processors": None,
        "native_kernel_flags": " ".join(build_flags()),
        "emulated": {name: os.environ[name] for name in EMULATIONS["avx2"] if name in os.environ},
    }
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                               env={**os.environ, "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"})
    except (OSError, subprocess.SubprocessError):
        return result
    if match := re.search(r"onednn_verbose,.*?,cpu,isa:(.*)", probe.stdout):
        result["onednn_isa"] = match.group(1).strip()
    if match := re.search(r"MKL_VERBOSE .* for Intel\(R\) 64 architecture (.*?), Lnx", probe.stdout):
        result["mkl_processors"] = match.group(1).strip()
    return result


def describe(extensions: dict[str, object]) -> str:
    """One line for the benchmark's output."""
    return (f"CPU {extensions['cpu_model']} [{' '.join(extensions['cpu_extensions'])}]; in effect: torch "
            f"{extensions['torch_capability']}, oneDNN {extensions['onednn_isa']}, MKL "
            f"{extensions['mkl_processors']}, native kernel {extensions['native_kernel_flags']}")


def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
