"""Frontends start in about a second: they must never import torch, even transitively.

pydantic is imported (FastAPI's, for /openapi.json and /docs) but never runs on a request: that is
checked on the apps themselves (``tests/frontends/test_worker_openapi.py``)."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "frontends.app", "api.openai_api", "api.anthropic_api", "api.generation",
    "api.detokenizer", "api.tokenizer", "api.errors", "api.streaming",
    "frontends.engine_client", "api.server",
    "frontends.admin_forwarder", "frontends.launcher_routes", "api.route_table", "frontends.prometheus",
    "frontends.perf_records", "frontends.watchdog", "frontends.worker_app",
]


def test_frontend_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in MODULES) + (
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_opentelemetry_sdk_loads_only_when_tracing_is_on():
    """Tracing off (the default), a request's path holds ``tracing = None``: the SDK and exporter,
    imported inside ``api.tracing.Tracing``, are never loaded by the apps' modules."""
    modules = [*MODULES, "api.tracing", "api.request_context", "orchestrator.app", "orchestrator.server",
               "orchestrator.request_end", "orchestrator.fast_http", "disagg.serve"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "print(','.join(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
