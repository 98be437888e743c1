"""A real headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by selenium.

    with chromium() as browser:
        browser.get(url + "/docs")

For pages a person opens (``/docs``): the test sees what the browser rendered and clicks what a
person clicks. Without Chromium a test skips, and fails under ``CI=1`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

__all__ = ["chromium"]

# Root in a container (no sandbox), no GPU, and nothing that reaches past loopback on its own
# (updates, sync, QUIC probes): the page is the only traffic.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1024")


def _binaries() -> tuple[str, str]:
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        message = "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message + "; .ci/run installs them")
        pytest.skip(message)
    return browser, driver


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """A fresh headless Chromium (its own profile directory, removed after)."""
    browser, driver = _binaries()
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        session = webdriver.Chrome(service=Service(driver), options=options)
        try:
            yield session
        finally:
            session.quit()
