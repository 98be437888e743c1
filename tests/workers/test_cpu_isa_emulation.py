"""``benchmarks/cpu_isa.py``: --emulate-isa avx2 limits torch, oneDNN and the native kernel, and says so."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# What a benchmark does first: emulate (re-executing itself), then report what is in effect.
SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(BENCHMARKS)!r})
from cpu_isa import emulate, vector_extensions
emulate(sys.argv[1] if len(sys.argv) > 1 else None)
print(json.dumps(vector_extensions()))
"""


def extensions_in_effect(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items() if "CPU_ISA" not in k and "CAPABILITY" not in k})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a child process per library (10-47 s on a loaded 2-core machine)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 vector extensions")
def test_emulated_avx2_limits_every_library_and_reports_it():
    native = extensions_in_effect()
    if "avx2" not in native["cpu_extensions"]:
        pytest.skip("this CPU has no AVX2 to emulate")
    emulated = extensions_in_effect("avx2")
    assert emulated["torch_capability"] == "AVX2"
    assert "AVX2" in emulated["onednn_isa"] and "512" not in emulated["onednn_isa"]
    assert emulated["native_kernel_flags"].endswith("-mno-avx512f")
    assert emulated["emulated"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert emulated["cpu_extensions"] == native["cpu_extensions"]  # the CPU is the same; what runs on it is not
    assert native["emulated"] == {} and native["onednn_isa"]
    if "avx512f" in native["cpu_extensions"]:
        assert native["torch_capability"] == "AVX512" and "-mno-avx512f" not in native["native_kernel_flags"]
