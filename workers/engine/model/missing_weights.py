"""The error both checkpoint loaders (safetensors and GGUF) raise for absent tensors."""

from __future__ import annotations

from pathlib import Path

__all__ = ["MissingWeightsError"]

_MAX_NAMES_IN_ERROR = 20


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs; ``names`` lists them all."""

    def __init__(self, model_dir: Path, names: list[str]) -> None:
        shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
        more = f" (and {len(names) - _MAX_NAMES_IN_ERROR} more)" if len(names) > _MAX_NAMES_IN_ERROR else ""
        super().__init__(f"{model_dir}: checkpoint is missing {len(names)} tensors: {shown}{more}")
        self.names = names
