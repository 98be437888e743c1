"""Installing the project prints nothing beyond pip's own lines, and the Makefile says what each target does."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("disagg", "orchestrator", "api", "workers", "frontends", "slurm", "common")


def test_building_the_package_prints_no_warning_banner(tmp_path):
    # A copy: a build writes build/ and *.egg-info next to pyproject.toml.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    # -v shows the build backend's own output, where setuptools prints its deprecation banners
    # (framed with "!!") for a pyproject.toml it would stop accepting.
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "-v", "-w", str(tmp_path / "wheel"), str(src)],
                            capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    noise = [line for line in output.splitlines()
             if "!!" in line or "Deprecation" in line or re.search(r"\bwarning: (?!.*byte-compiling)", line, re.I)]
    assert noise == [], noise
    assert len(list((tmp_path / "wheel").glob("disagg-*.whl"))) == 1


def test_every_make_target_says_what_it_does():
    makefile = (ROOT / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split())
    described = set(re.findall(r"^([a-z-]+):.*## ", makefile, re.M))
    assert phony - described == set(), "add `## what it does` to these targets"
    listing = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "help"], capture_output=True,
                             text=True, timeout=30)
    assert listing.returncode == 0 and all(f"make {target} " in listing.stdout for target in phony), listing
