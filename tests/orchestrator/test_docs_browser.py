"""``/docs`` and ``/redoc`` of a real worker and of a real orchestrator in front of it, in headless Chromium.

The page must render the OpenAPI 3.1 document (every operation listed, no "Unable to render this
definition") from the server's own assets, and "Try it out" → Execute on ``POST /v1/chat/completions``
must get a 200 shown in the page; on the orchestrator, with an API key set, only after the key is
entered in the Authorize dialog. ``/redoc`` (ReDoc) must list every operation too. Every file either
page loads comes from the server itself.
"""

from __future__ import annotations

import httpx
import pytest
from browser import chromium
from openapi_check import operations
from orchestrator_process import start_orchestrator, stop_orchestrator
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from swagger_page import TIMEOUT, SwaggerPage, loaded
from worker_process import start_worker, stop_worker

pytestmark = pytest.mark.slow  # a browser, a worker and an orchestrator: some seconds each
KEY = "the-key"


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    """(worker URL, orchestrator URL) of a worker and an orchestrator that needs ``KEY``."""
    worker_url, worker = start_worker(tiny_model_dir, 1)
    try:
        url, orch = start_orchestrator(tmp_path_factory.mktemp("orch"), tiny_model_dir, [("both", worker_url)],
                                       processes=1, api_key=KEY)
    except BaseException:
        stop_worker(worker)
        raise
    yield worker_url, url
    assert stop_orchestrator(orch) == 0
    assert stop_worker(worker) == 0


@pytest.fixture(scope="module")
def browser():
    with chromium() as session:
        yield session


def _chat(url: str) -> dict:
    model = httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}, timeout=30).json()["data"][0]["id"]
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def _rendered(page: SwaggerPage, url: str, doc: dict) -> None:
    text = page.text()
    assert "Unable to render" not in text and "OAS 3.1" in text, text[:2000]
    assert page.paths() == set(doc["paths"]), "every documented operation is listed"
    _all_from(url, page.loaded(), "swagger-ui-bundle.js")


def _all_from(url: str, loaded: dict[str, int], script: str) -> None:
    """The page's script and the document were loaded, everything from this server (no CDN), all 200."""
    assert f"{url}/docs/assets/{script}" in loaded and f"{url}/openapi.json" in loaded, loaded
    assert all(u.startswith(f"{url}/") and status == 200 for u, status in loaded.items()), loaded


def _redoc_renders(browser, url: str, doc: dict) -> None:
    """/redoc lists every documented operation (a section per operationId)."""
    browser.get(f"{url}/redoc")
    sections = WebDriverWait(browser, TIMEOUT).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "[data-section-id^='operation/']"))
    ids = {e.get_attribute("data-section-id") for e in sections}
    assert ids == {f"operation/{op['operationId']}" for _, _, op in operations(doc)}, ids
    _all_from(url, loaded(browser), "redoc.standalone.js")


def test_worker_docs_render_and_try_it_out_answers(deployment, browser):
    url = deployment[0]
    doc = httpx.get(f"{url}/openapi.json", timeout=30).json()
    page = SwaggerPage(browser, url)
    _rendered(page, url, doc)
    status, answer = page.try_it_out(doc, "POST", "/v1/chat/completions", _chat(url))
    assert status.split()[0] == "200", (status, answer)
    assert '"chat.completion"' in answer and '"completion_tokens": 4' in answer, answer
    _redoc_renders(browser, url, doc)


def test_orchestrator_docs_with_an_api_key(deployment, browser):
    url = deployment[1]
    doc = httpx.get(f"{url}/openapi.json", timeout=30).json()  # open, as /docs is
    page = SwaggerPage(browser, url)
    _rendered(page, url, doc)
    status, answer = page.try_it_out(doc, "POST", "/v1/chat/completions", _chat(url))
    assert status.split()[0] == "401", (status, answer)  # no key entered yet
    page.authorize("x-api-key", KEY)
    status, answer = page.try_it_out(doc, "POST", "/v1/chat/completions", _chat(url))
    assert status.split()[0] == "200", (status, answer)
    assert '"chat.completion"' in answer, answer
    _redoc_renders(browser, url, doc)
