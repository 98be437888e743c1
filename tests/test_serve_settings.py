"""``disagg serve``'s typed settings: built once from the flags, rendered back for attached frontends."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from disagg.serve import add_serve_arguments
from disagg.serve_settings import ServeSettings
from workers.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


def test_an_attached_frontend_argv_parses_back_to_the_same_settings():
    parser = _parser()
    settings = ServeSettings.from_args(parser.parse_args([
        "model", "--num-frontends", "2", "--engine", "synthetic", "--access-log", "--max-perf-records", "7",
        "--register-url", "http://orch:1", "--synthetic-decode-step-seconds", "0.25", "--frontend-command", "x y"]))
    argv = settings.argv(["python", "-m", "disagg.cli"], num_frontends=3)
    assert argv[:5] == ["python", "-m", "disagg.cli", "serve", "model"] and "--frontend-command" not in argv
    again = ServeSettings.from_args(parser.parse_args(argv[4:]))
    assert again == dataclasses.replace(settings, num_frontends=3, frontend_command=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]  # frozen: the one object every function below reads


def test_a_missing_or_mistyped_flag_is_named():
    args = _parser().parse_args(["model"])
    args.max_num_seqs = "64"
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        ServeSettings.from_args(args)
    del args.max_num_seqs
    with pytest.raises(ConfigError, match="--max-num-seqs.*missing"):
        ServeSettings.from_args(args)


def test_every_flag_is_a_setting():
    """A flag missing here would silently not reach the attached frontends."""
    dests = {action.dest for action in _parser()._actions if action.dest != "help"}
    assert dests == {field.name for field in dataclasses.fields(ServeSettings)}
