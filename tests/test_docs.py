"""The repository's docs keep up with the code: every deployment YAML key is documented."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from disagg.deploy_config import DeployConfig, EngineSettings

DOCS = Path(__file__).resolve().parents[1] / "docs"
INTERNAL = {"source"}  # set by the loader, not a YAML key


def yaml_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted; a pool's keys once as ``pools.<role>``, and its
    engine overrides not again (they are the ``engine`` keys)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in INTERNAL:
            continue
        hint = hints[field.name]
        key = f"{prefix}{field.name}"
        if hint is EngineSettings and prefix.startswith("pools."):
            keys.append(key)
        elif dataclasses.is_dataclass(hint):
            keys += yaml_keys(hint, f"{key}.")
        else:
            keys.append(key)
    return sorted({key.replace("pools.ctx.", "pools.<role>.").replace("pools.gen.", "pools.<role>.") for key in keys})


def test_every_yaml_key_is_in_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    keys = yaml_keys(DeployConfig)
    assert "engine.kind" in keys and "pools.<role>.frontends" in keys and "restarts.window_seconds" in keys
    missing = [key for key in keys if f"`{key}`" not in page]
    assert missing == [], f"document these keys in docs/configuration.md: {missing}"


def test_the_readme_links_the_docs_that_exist():
    readme = (DOCS.parent / "README.md").read_text()
    for page in ("architecture.md", "operations.md", "configuration.md"):
        assert (DOCS / page).is_file() and f"docs/{page}" in readme
