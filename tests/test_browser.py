"""The WebUI in a real headless Chromium (Selenium): upload a prompt, generate, hear it play, read the panels, and the
controls that only a browser shows (disabled speed while streaming, settings after a reload, upload checks)."""

from __future__ import annotations

import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from cosyvoice_opt import limits
from cosyvoice_opt.webui.settings import BATCH_SLIDER_MAX, READ_ONLY
from tests import test_app
from tests.test_app import PROMPT, PROMPT_TEXT, TEXT

engine, server = test_app.engine, test_app.server  # the same in-process app fixtures (module scope)
operator_server = test_app.operator_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The README's screenshot: `COSYVOICE_SCREENSHOT=docs/screenshot.png ./run.sh test tests/test_browser.py`.
SCREENSHOT = os.environ.get("COSYVOICE_SCREENSHOT")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium"),
]


class Page:
    """A driver on one page of the app, with waits on what the page shows (never fixed sleeps)."""

    def __init__(self, driver, url: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        self.wait = WebDriverWait(driver, 120, poll_frequency=0.1)
        driver.get(url)
        self.css("#zero_shot_btn")

    def css(self, selector: str):
        from selenium.webdriver.common.by import By

        return self.wait.until(lambda d: d.find_element(By.CSS_SELECTOR, selector))

    def until(self, condition):
        return self.wait.until(lambda _: condition())

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def text_of(self, selector: str) -> str:
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", selector)

    def errors(self) -> list[str]:
        """Texts of the error toasts on the page."""
        return self.js("return [...document.querySelectorAll('.toast-body.error')].map(e => e.innerText);")

    def upload(self, elem_id: str, path: Path) -> None:
        self.css(f"#{elem_id} input[type=file]").send_keys(str(path))

    def fill(self, selector: str, text: str) -> None:
        box = self.css(selector)
        box.clear()
        box.send_keys(text)

    def generate_zero_shot(self) -> None:
        """Uploads the example prompt, fills both texts and clicks Generate in the 3 s clone tab."""
        self.upload("zero_shot_prompt", PROMPT)
        self.css("#zero_shot_prompt audio, #zero_shot_prompt .waveform-container")  # upload shown
        self.fill("#zero_shot_prompt_text textarea", PROMPT_TEXT)
        self.fill("#zero_shot_text textarea", TEXT)
        self.css("#zero_shot_btn").click()


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


def _speed(page: Page) -> tuple[bool, str]:
    """(enabled, value) of the speed slider's number box."""
    return page.js("const i = document.querySelector('#speed input[type=number]'); return [!i.disabled, i.value];")


def test_speed_is_disabled_while_streaming(browser, server):
    page = Page(browser, server)
    assert page.css("#stream input[type=checkbox]").is_selected()
    assert page.until(lambda: _speed(page) == [False, "1"])  # streaming on by default: speed off
    page.css("#stream input[type=checkbox]").click()  # streaming off: speed on
    page.until(lambda: _speed(page)[0])
    box = page.css("#speed input[type=number]")
    box.clear()
    box.send_keys("1.5\t")
    page.until(lambda: page.js("return document.querySelector('#speed input[type=range]').value") == "1.5")
    page.css("#stream input[type=checkbox]").click()  # streaming back on: reset to 1.0 and disabled
    assert page.until(lambda: _speed(page) == [False, "1"])
    assert page.js("return document.querySelector('#speed input[type=range]').disabled")
    page.generate_zero_shot()
    page.until(lambda: '"chunks"' in page.text_of("#metrics") or page.errors())
    assert not page.errors() and "first_packet_latency_s" in page.text_of("#metrics")


def _settings_shown(page: Page) -> dict:
    return page.js("""
        const q = s => document.querySelector(s);
        if (!q('#max_batch_size input[type=number]') || !q('#precision input') || !q('#precision_btn')) return {};
        return {batch: q('#max_batch_size input[type=number]').value,
                batch_enabled: !q('#max_batch_size input[type=number]').disabled,
                wait: q('#max_queue_wait input[type=number]').value,
                precision: q('#precision input').value,
                precision_enabled: !q('#precision input').disabled,
                apply_enabled: !q('#precision_btn').disabled};""")


def test_every_page_load_shows_the_engines_settings(browser, server, engine):
    page = Page(browser, server)
    page.until(lambda: READ_ONLY in page.text_of("#settings_note"))
    shown = _settings_shown(page)
    assert not (shown["batch_enabled"] or shown["precision_enabled"] or shown["apply_enabled"])
    try:
        engine.set_max_batch_size(13)
        engine.set_max_queue_wait(7.5)
        browser.refresh()
        page.until(lambda: _settings_shown(page).get("batch") == "13")
        assert _settings_shown(page)["wait"] == "7.5"
        assert _settings_shown(page)["precision"] == engine.info["precision"]
    finally:
        engine.set_max_batch_size(64)
        engine.set_max_queue_wait(limits.MAX_QUEUE_WAIT_S)


def test_operator_sees_editable_settings(browser, operator_server):
    page = Page(browser, operator_server)
    shown = page.until(lambda: (s := _settings_shown(page)).get("batch_enabled") and s)
    assert shown["precision_enabled"] and shown["apply_enabled"]
    assert READ_ONLY not in page.text_of("#settings_note")


def test_non_audio_upload_is_named_at_once(browser, server, tmp_path):
    notes = tmp_path / "notes.wav"  # a .txt is refused by the browser itself; this one has an audio name
    notes.write_text("these are meeting notes, not speech\n" * 50)
    page = Page(browser, server)
    page.upload("zero_shot_prompt", notes)
    page.until(lambda: "could not be decoded" in page.text_of("#zero_shot_prompt_check"))
    page.css("#zero_shot_prompt button[aria-label=Clear]").click()  # clearing the file clears its message
    page.until(lambda: not page.text_of("#zero_shot_prompt_check").strip())
    short = test_app._wav(tmp_path, "short.wav", test_app._tone(0.2))  # audio, but too short to clone from
    page.upload("zero_shot_prompt", Path(short))
    page.until(lambda: "0.2 s long" in page.text_of("#zero_shot_prompt_check"))


def test_dice_draws_from_the_engines_whole_seed_range(browser, server):
    page = Page(browser, server)

    def seed() -> str:
        return page.js("return document.querySelector('#seed input').value")

    seeds = [int(seed())]
    while max(seeds) <= 2**31 - 1:  # half the range lies above the old cap: a few throws suffice
        assert len(seeds) < 64, "the dice never went above 2**31 - 1"
        page.css("#dice").click()
        page.until(lambda: seed() != str(seeds[-1]))
        seeds.append(int(seed()))
        assert 0 <= seeds[-1] <= limits.MAX_SEED


def test_plot_legend_and_example_transcripts_are_shown_whole(browser, server):
    page = Page(browser, server)
    page.css("#gpu_plot .role-legend")
    legend, *frames = page.js("""
        const box = s => { const r = document.querySelector(s).getBoundingClientRect();
                           return [r.top, r.bottom, r.left, r.right]; };
        return [box('#gpu_plot .role-legend'), box('#gpu_plot svg'), box('#gpu_plot')];""")
    for top, bottom, left, right in frames:  # inside the drawing and inside the block that clips it
        assert top <= legend[0] and legend[1] <= bottom and left <= legend[2] and legend[3] <= right
    wrap = page.css("#examples .table-wrap")
    assert page.js("return arguments[0].scrollWidth <= arguments[0].clientWidth", wrap), "the table scrolls sideways"
    assert PROMPT_TEXT in page.text_of("#examples")  # the whole transcript, not its first 60 characters
    page.css("#examples tbody tr:nth-child(2) td:nth-child(2)").click()  # en_male's row fills the inputs
    page.until(lambda: page.js("return document.querySelector('#zero_shot_prompt_text textarea').value")
               == PROMPT_TEXT)


def test_generate_and_play_in_chromium(browser, server, tmp_path):
    page = Page(browser, server)
    page.generate_zero_shot()
    played = page.until(lambda: page.js(
        "const a = document.querySelector('#out_stream audio');"
        "return a && (a.currentTime > 0 || a.played.length > 0) ? a.currentTime : null;"))
    assert played is not None
    download = page.css("#out_full a[download]")  # the full clip comes with the last chunk
    with urllib.request.urlopen(download.get_attribute("href")) as response:
        assert response.read(4) == b"RIFF"
    metrics = page.text_of("#metrics")
    assert "first_packet_latency_s" in metrics and "rtf" in metrics and "chunks" in metrics
    gpu = page.text_of("#gpu_panel")
    assert ("Memory:" in gpu and "Utilisation:" in gpu) or "No NVIDIA GPU: running on CPU" in gpu
    assert "Requests:" in page.text_of("#engine_panel")

    browser.execute_script("window.scrollTo(0, 0)")
    shot = tmp_path / "screenshot.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if SCREENSHOT:
        shutil.copyfile(shot, SCREENSHOT)


def test_a_failed_generate_names_its_reason_in_the_tab(browser, server):
    """The reason stays under the tab's button, in the tab's words; the outputs are not marked "Error"."""
    page = Page(browser, server)
    page.js("[...document.querySelectorAll('button[role=tab]')].find(b => b.innerText.includes('Cross-lingual'))"
            ".click()")
    page.css("#cross_lingual_btn").click()
    page.until(lambda: "Add a prompt voice" in page.text_of("#cross_lingual_status"))
    assert "mode" not in page.text_of("#cross_lingual_status")
    assert not any("Error" in page.text_of(f"#{name}") for name in ("out_stream", "out_full", "metrics"))


def test_a_refused_setting_shows_what_the_engine_has(browser, operator_server, engine):
    page = Page(browser, operator_server)
    page.until(lambda: _settings_shown(page).get("batch_enabled"))
    before = engine.info["max_batch_size"]
    for typed, reason in (("2.5", "whole number"), (str(BATCH_SLIDER_MAX + 100), "greater than maximum value")):
        page.fill("#max_batch_size input[type=number]", typed + "\t")
        page.until(lambda reason=reason: any(reason in e for e in page.errors()))  # refused, with the reason
        # the box shows what the engine has, not the typed value clamped to the slider's range
        assert page.until(lambda: _settings_shown(page)["batch"] == str(before))
        assert page.text_of("#settings_status") == f"Refused: the engine keeps max batch size {before} and max " \
            f"queue wait {engine.info['max_queue_wait']:g} s."
        assert engine.info["max_batch_size"] == before
