"""The WebUI in a real headless Chromium (Selenium): upload a prompt, generate, hear it play, read the panels."""

from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests import test_app
from tests.test_app import PROMPT, PROMPT_TEXT, TEXT

engine, server = test_app.engine, test_app.server  # the same in-process app fixtures (module scope)

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The README's screenshot: `COSYVOICE_SCREENSHOT=docs/screenshot.png ./run.sh test tests/test_browser.py`.
SCREENSHOT = os.environ.get("COSYVOICE_SCREENSHOT")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required", "--window-size=1500,1900",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager never looks for (or downloads) a browser or driver.
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()


def test_generate_and_play_in_chromium(browser, server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def css(selector):
        return browser.find_element(By.CSS_SELECTOR, selector)

    browser.get(server)
    wait = WebDriverWait(browser, 120, poll_frequency=0.2)
    wait.until(lambda _: css("#zero_shot_prompt input[type=file]")).send_keys(str(PROMPT))
    wait.until(lambda _: css("#zero_shot_prompt audio, #zero_shot_prompt .waveform-container"))  # upload shown
    css("#zero_shot_prompt_text textarea").send_keys(PROMPT_TEXT)
    target = css("#zero_shot_text textarea")
    target.clear()
    target.send_keys(TEXT)
    css("#zero_shot_btn").click()

    played = wait.until(lambda _: browser.execute_script(
        "const a = document.querySelector('#out_stream audio');"
        "return a && (a.currentTime > 0 || a.played.length > 0) ? a.currentTime : null;"))
    assert played is not None
    download = wait.until(lambda _: css("#out_full a[download]"))  # the full clip comes with the last chunk
    with urllib.request.urlopen(download.get_attribute("href")) as response:
        assert response.read(4) == b"RIFF"
    metrics = css("#metrics").text
    assert "first_packet_latency_s" in metrics and "rtf" in metrics and "chunks" in metrics
    gpu = css("#gpu_panel").text
    assert ("Memory:" in gpu and "Utilisation:" in gpu) or "No NVIDIA GPU: running on CPU" in gpu
    assert "Requests:" in css("#engine_panel").text

    browser.execute_script("window.scrollTo(0, 0)")
    shot = tmp_path / "screenshot.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if SCREENSHOT:
        shutil.copyfile(shot, SCREENSHOT)
