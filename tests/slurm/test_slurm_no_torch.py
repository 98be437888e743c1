from __future__ import annotations

import subprocess
import sys


def test_slurm_package_is_torch_free() -> None:
    code = ("import sys, slurm.config, slurm.placement, slurm.plan, slurm.render, slurm.jobs, slurm.submit, "
            "slurm.step, slurm.rendezvous, disagg.slurm_deployment, disagg.deploy_config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr
