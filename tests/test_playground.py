"""The playground page at / in a real browser: Debian's chromium, headless, driven by selenium through Debian's
chromium-driver, against the session's `h3serve serve` ("playground": the default config, one request in the pack
at a time, ``served_apps``). A token-locked server's page is tested in test_api_http, on its "locked" application:
no application is started for that alone.

`make screenshots` runs this module alone with H3SERVE_SCREENSHOTS=docs/images, where the README's picture goes."""

import os
from pathlib import Path

import pytest

from tests.harness import REPO, browser_or_skip, wait

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
PROMPT = "a red circle moving left with a high beep"  # the README's


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


@pytest.fixture(scope="module")
def browser(server):
    driver = browser_or_skip()
    yield driver
    driver.quit()


def card(driver, index: int = 0):
    from selenium.webdriver.common.by import By

    cards = driver.find_elements(By.CSS_SELECTOR, "#jobs .card")
    return cards[index] if len(cards) > index else None


def submit(driver, prompt: str, steps: int, seconds: str = "") -> str:
    """Fill the form and submit; the new card's video id."""
    from selenium.webdriver.common.by import By

    before = {e.get_attribute("id") for e in driver.find_elements(By.CSS_SELECTOR, "#jobs .card")}
    for field, value in (("prompt", prompt), ("steps", str(steps)), ("seconds", seconds)):
        element = driver.find_element(By.ID, field)
        element.clear()
        if value:
            element.send_keys(value)
    driver.find_element(By.ID, "submit").click()

    def new_card(d):
        ids = {e.get_attribute("id") for e in d.find_elements(By.CSS_SELECTOR, "#jobs .card")} - before
        return next(iter(ids), None)

    return wait(driver, new_card, 60, "a card for the new job").removeprefix("job-")


def test_the_page_generates_shows_previews_plays_the_clip_and_cancels(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    assert browser.title == "h3serve playground"
    wait(browser, lambda d: d.find_element(By.ID, "auth-state").text == "open server: no key needed", 30, "auth state")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"), 30, "models and jobs")
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#cache option")][0].startswith("off")

    first = submit(browser, PROMPT, 16)
    second = submit(browser, "a blue square moving up", 50, "14")  # waits behind the first, then runs long
    el = browser.find_element(By.ID, f"job-{second}")
    wait(browser, lambda d: "position" in el.find_element(By.CLASS_NAME, "detail").text, 60, "a queue position")
    mine = browser.find_element(By.ID, f"job-{first}")
    wait(browser, lambda d: int(mine.get_attribute("data-previews")) >= 3, 120, "three distinct previews")
    video = mine.find_element(By.CSS_SELECTOR, "video.clip")
    wait(browser, lambda d: d.execute_script("return arguments[0].readyState >= 1", video), 120, "the clip to load")
    duration = browser.execute_script("return arguments[0].duration", video)
    assert abs(duration - 124 / 24) < 0.1, duration  # the shortest clip: 124 frames at 24 fps
    browser.execute_script("arguments[0].play()", video)
    wait(browser, lambda d: d.execute_script("return arguments[0].currentTime", video) > 0.2, 30, "the clip to play")
    link = mine.find_element(By.CLASS_NAME, "download")
    assert link.get_attribute("download") == f"{first}.mp4" and link.get_attribute("href").startswith("blob:")
    # the second one, running now: cancel it from its card
    wait(browser, lambda d: "step" in el.find_element(By.CLASS_NAME, "detail").text, 120, "the second job to run")
    el.find_element(By.CLASS_NAME, "cancel").click()
    wait(browser, lambda d: el.get_attribute("data-status") == "cancelled", 60, "the second job cancelled")
    assert el.find_element(By.CLASS_NAME, "status").text == "cancelled"
    wait(browser, lambda d: d.find_element(By.ID, "stat-queue").text.startswith("0 waiting"), 30, "the live panel")
    assert browser.find_element(By.ID, "stat-admission").text == "0"
    screenshots = Path(os.environ.get("H3SERVE_SCREENSHOTS", REPO / "tests" / ".screenshots"))
    screenshots.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(screenshots / "playground.png"))
