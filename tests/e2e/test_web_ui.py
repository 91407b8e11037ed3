"""The chat page (/) and the cache dashboard (/dashboard) in a real headless browser:
Debian's chromium driven by Playwright against a live `memserve up`. Skips when
playwright or /usr/bin/chromium is missing (scripts/bootstrap.sh test installs both
where it can). Screenshots go to the test's tmp dir; their paths are printed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
XSS = '<img src=x onerror=alert(1)><script>alert(2)</script>'

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, memserve_server):
    context = browser.new_context(base_url=memserve_server.base_url, viewport={"width": 1280, "height": 900})
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.dialogs = dialogs
    yield page
    context.close()


def _shot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def _send(page, text: str) -> None:
    page.fill("#input", text)
    page.click("#send")


def test_chat_streams_and_reuses_the_cache(page, tmp_path):
    page.goto("/")
    page.wait_for_selector("#model option", state="attached")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    _send(page, "Write one sentence about the sea.")
    first = page.locator(".msg.assistant").nth(0)
    page.wait_for_selector(".msg.assistant[data-done]", timeout=90000)
    assert first.locator(".body").inner_text().strip()
    assert "TTFT" in first.locator(".turn-stats").inner_text()
    _send(page, "And one about the mountains.")
    page.locator(".msg.assistant[data-done]").nth(1).wait_for(timeout=90000)
    second = page.locator(".msg.assistant").nth(1)
    cached = int(second.get_attribute("data-cached-tokens"))
    assert cached > 0, "the second turn should reuse the first turn's KV cache"
    assert f"cached {cached} /" in second.locator(".turn-stats").inner_text()
    _shot(page, tmp_path, "chat")
    assert page.dialogs == []


def test_model_and_user_text_are_never_html(page, tmp_path):
    page.goto("/")
    page.wait_for_selector("#model option", state="attached")
    page.fill("#max-tokens", "4")
    # An assistant message through the page's own renderer, with markdown around it.
    page.evaluate("(x) => window.memserveChat.addMessage('assistant', 'see **this** `' + x + '`\\n\\n' + x + "
                  "'\\n```html\\n' + x + '\\n```')", XSS)
    _send(page, XSS)
    page.wait_for_selector(".msg.assistant[data-done]", timeout=90000)
    page.wait_for_timeout(300)
    conversation = page.locator("#conversation")
    assert conversation.locator("img").count() == 0
    assert conversation.locator("script").count() == 0
    assert page.locator(".msg.user .body").inner_text() == XSS
    injected = page.locator(".msg.assistant").nth(0)
    assert injected.locator("strong").inner_text() == "this"
    assert injected.locator("p code").inner_text() == XSS
    assert injected.locator("pre code").inner_text() == XSS
    assert page.dialogs == []
    _shot(page, tmp_path, "xss")


def test_dashboard_follows_the_blocks(page, tmp_path, memserve_server):
    from openai import OpenAI

    page.goto("/dashboard")
    page.wait_for_selector("body[data-snapshots]", state="attached", timeout=15000)
    instance = page.locator("[id^=inst-]").first.get_attribute("id").split("-")[1]
    cells = [f"#blocks-{instance}-device-used", f"#blocks-{instance}-device-cached"]
    client = OpenAI(base_url=memserve_server.base_url + "/v1", api_key="none")

    def load() -> None:
        for i in range(3):
            client.completions.create(model=memserve_server.model, max_tokens=4, temperature=0,
                                      prompt=f"Request {i} {time.time()}: " + "count the stars and the waves " * 12)

    worker = threading.Thread(target=load)
    seen = set()
    worker.start()
    deadline = time.monotonic() + 90
    while (worker.is_alive() or len(seen) < 2) and time.monotonic() < deadline:
        seen.add(tuple(page.locator(c).inner_text() for c in cells))
        page.wait_for_timeout(250)
    worker.join()
    page.wait_for_timeout(1200)
    seen.add(tuple(page.locator(c).inner_text() for c in cells))
    assert len(seen) >= 2, f"the device block counts never changed: {seen}"
    assert page.locator(f"#chart-blocks-{instance} polyline").count() >= 2
    assert page.locator("#conn").inner_text() == "live"
    _shot(page, tmp_path, "dashboard")
    assert page.dialogs == []
