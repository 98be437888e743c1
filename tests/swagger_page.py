"""What a person does on a ``/docs`` page (Swagger UI 5) in a real browser (``browser.chromium``).

    page = SwaggerPage(browser, url)          # opens url/docs, waits until the operations render
    page.paths()                              # every path the page lists
    page.authorize("x-api-key", KEY)          # the Authorize dialog
    status, body = page.try_it_out(doc, "POST", "/v1/chat/completions", {"model": ..., ...})

Elements are found by Swagger UI's own classes and ids (``operations-{tag}-{operationId}``).
"""

from __future__ import annotations

import json
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

__all__ = ["SwaggerPage", "loaded"]

TIMEOUT = 120.0  # a loaded 2-core machine: rendering 1.5 MB of script, a request through two servers


def loaded(browser: WebDriver) -> dict[str, int]:
    """URL -> HTTP status of every resource the open page loaded (the browser's Resource Timing)."""
    entries = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => [e.name, e.responseStatus])")
    return dict(entries)


class SwaggerPage:
    def __init__(self, browser: WebDriver, url: str) -> None:
        self.browser = browser
        browser.get(f"{url}/docs")
        self._wait(lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock")
                   or b.find_elements(By.CSS_SELECTOR, ".errors-wrapper, .version-pragma, .loading-container .info"))

    def _wait(self, condition: Any, within: WebElement | None = None) -> Any:
        return WebDriverWait(within or self.browser, TIMEOUT).until(condition)

    def text(self) -> str:
        return self.browser.find_element(By.TAG_NAME, "body").text

    def paths(self) -> set[str]:
        """Every operation's path as the page lists it."""
        return {e.get_attribute("data-path") or "" for e in
                self.browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}

    def loaded(self) -> dict[str, int]:
        """Every URL the page loaded (scripts, styles, images, fetches) and its HTTP status, as the browser
        records them."""
        return loaded(self.browser)

    def authorize(self, scheme: str, value: str) -> None:
        """Enter ``value`` for the security scheme ``scheme`` in the Authorize dialog."""
        self.browser.find_element(By.CSS_SELECTOR, ".auth-wrapper button.authorize").click()
        dialog = self._wait(lambda b: b.find_element(By.CSS_SELECTOR, ".modal-ux"))
        form = next(f for f in dialog.find_elements(By.CSS_SELECTOR, ".auth-container")
                    if scheme in f.find_element(By.TAG_NAME, "h4").text)
        form.find_element(By.TAG_NAME, "input").send_keys(value)
        form.find_element(By.CSS_SELECTOR, "button.authorize").click()
        dialog.find_element(By.CSS_SELECTOR, "button.btn-done, button.close-modal").click()

    def try_it_out(self, doc: dict[str, Any], method: str, path: str, body: Any) -> tuple[str, str]:
        """Open the operation, Try it out, put ``body`` in the request box, Execute: the status code and
        the response body the page then shows."""
        operation = doc["paths"][path][method.lower()]
        block = self.browser.find_element(By.ID, f"operations-{operation['tags'][0]}-{operation['operationId']}")
        if "is-open" not in (block.get_attribute("class") or ""):
            block.find_element(By.CSS_SELECTOR, ".opblock-summary-control").click()
        if not block.find_elements(By.CSS_SELECTOR, "button.try-out__btn.cancel"):
            self._wait(lambda _: block.find_element(By.CSS_SELECTOR, "button.try-out__btn")).click()
        box = self._wait(lambda _: block.find_element(By.CSS_SELECTOR, "textarea.body-param__text"))
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(json.dumps(body))
        for old in block.find_elements(By.CSS_SELECTOR, "button.btn-clear"):
            old.click()  # the last Execute's answer: wait for this one's
        block.find_element(By.CSS_SELECTOR, "button.execute").click()
        answer_row = ".live-responses-table tr.response"  # the header row has the same column classes
        status = self._wait(lambda _: block.find_element(By.CSS_SELECTOR, f"{answer_row} .response-col_status"))
        answer = block.find_element(By.CSS_SELECTOR, f"{answer_row} .response-col_description")
        return status.text.strip(), answer.text
