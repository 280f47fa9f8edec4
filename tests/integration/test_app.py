"""The Streamlit demo app: its flows through Streamlit's AppTest, and one real run in
headless Chromium."""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("streamlit")

from ragblend.data import sample_dir  # noqa: E402
from tests.servers import ServerProcess, free_port, http_ok, non_loopback_address  # noqa: E402

pytestmark = pytest.mark.slow

APP = str(Path(__file__).resolve().parents[2] / "apps" / "streamlit_app.py")
QUESTION = "In which year did the Lowenmark Kite Festival begin?"


@pytest.fixture(autouse=True)
def engines_freed_after_each_test():
    """Streamlit keeps ``st.cache_resource`` values for the whole process: without this, every
    test's engine (and its model) stays in memory until the test run ends."""
    yield
    import streamlit as st

    st.cache_resource.clear()


def start_app(monkeypatch, index_dir, files_root=None):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("RAGBLEND_INDEX_DIR", str(index_dir))
    if files_root is None:
        monkeypatch.delenv("RAGBLEND_FILES_ROOT", raising=False)
    else:
        monkeypatch.setenv("RAGBLEND_FILES_ROOT", str(files_root))
    at = AppTest.from_file(APP, default_timeout=300)
    at.run()
    assert not at.exception
    return at


@pytest.fixture
def app(tmp_path, monkeypatch):
    """The app, allowed to read files under tmp_path."""
    return start_app(monkeypatch, tmp_path / "index", files_root=tmp_path)


def button(at, key):
    return next(b for b in at.button if b.key == key)


def test_question_before_ingestion_explains_what_to_do(app):
    app.text_input(key="question").input(QUESTION)
    button(app, "ask").click().run()
    assert any("index is empty" in i.value and "Ingest documents first" in i.value for i in app.info)


def test_ingest_ask_and_compare(app, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(sample_dir(), docs)
    (docs / "scan.pdf").write_bytes(b"%PDF-1.4 not text")
    (docs / "empty.md").write_text("\n")
    app.text_input(key="folder").input(str(docs))
    button(app, "ingest").click().run()
    assert not app.exception
    assert any("Ingested 6 file(s)" in s.value for s in app.success)
    warnings = " ".join(w.value for w in app.warning)
    assert "scan.pdf" in warnings and "not a readable PDF" in warnings and "empty.md" in warnings

    # the ratio slider's default is the ratio in force, shown (not changeable) under the default strategy
    in_force = next(c.value for c in app.sidebar.caption if c.value.startswith("In force by default"))
    assert app.sidebar.slider[0].disabled and f"at ratio {app.sidebar.slider[0].value:.2f}, " in in_force
    app.text_input(key="question").input(QUESTION)
    button(app, "ask").click().run()
    assert not app.exception
    shown = " ".join(m.value for m in app.markdown)
    assert "1987" in shown
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["TTFT with fusion"].endswith(" s") and metrics["TTFT full prefill"].endswith(" s")
    reused, total = metrics["Prompt tokens reused"].split(" / ")
    assert int(reused) > 0.5 * int(total)
    assert "background:#ffd166" in shown   # recomputed tokens marked in the prompt
    per_chunk = [tuple(map(int, m)) for m in re.findall(r"cached KV: (\d+) of (\d+) tokens reused, (\d+) recomputed", shown)]
    assert per_chunk and all(reused + fresh == total for reused, total, fresh in per_chunk)
    assert sum(fresh for _, _, fresh in per_chunk) > 0 and sum(reused for reused, _, _ in per_chunk) > 0
    assert app.session_state["history"][0]["TTFT full prefill (s)"] > 0

    app.selectbox[0].set_value("full_reuse")
    app.checkbox[0].uncheck()
    button(app, "ask").click().run()
    assert len(app.session_state["history"]) == 2
    assert {m.label: m.value for m in app.metric}["TTFT full prefill"] == "–"


def test_without_a_files_root_the_path_box_is_off(tmp_path, monkeypatch):
    at = start_app(monkeypatch, tmp_path / "index")
    assert "folder" not in [t.key for t in at.text_input]
    assert any("--files-root" in c.value for c in at.caption)
    assert all(t.disabled for t in at.sidebar.text_input)   # index, model, Chroma: the operator's


def test_a_path_outside_the_files_root_is_refused(tmp_path, monkeypatch):
    root, outside = tmp_path / "shared", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("the password is swordfish\n")
    (root / "leak.txt").symlink_to(outside / "secret.txt")
    at = start_app(monkeypatch, tmp_path / "index", files_root=root)
    for hostile in (str(outside / "secret.txt"), "../outside/secret.txt", "leak.txt", "/etc/passwd"):
        at.text_input(key="folder").input(hostile)
        button(at, "ingest").click().run()
        assert not at.exception
        assert any("outside the folder this app may read" in e.value for e in at.error), hostile
        assert not at.success
    assert "0 chunk(s)" in " ".join(c.value for c in at.caption)


def test_ragblend_app_listens_on_this_machine_only(tmp_path):
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to test from")
    port = free_port()
    env = {**os.environ, "STREAMLIT_SERVER_HEADLESS": "true"}
    server = ServerProcess([sys.executable, "-m", "ragblend.cli", "app", "--port", str(port),
                            "--index", str(tmp_path / "index")], http_ok(f"http://127.0.0.1:{port}/_stcore/health"),
                           "the app", timeout_s=60, own_session=True,   # stop() ends the CLI and its streamlit
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(OSError):   # refused: nothing listens on the network's interface
            socket.create_connection((address, port), timeout=3).close()
    finally:
        server.stop()


def test_sigterm_to_ragblend_app_stops_the_app(tmp_path):
    """A service manager or `kill` signals the process it started, not its group: the app must go."""
    port = free_port()
    env = {**os.environ, "STREAMLIT_SERVER_HEADLESS": "true"}
    server = ServerProcess([sys.executable, "-m", "ragblend.cli", "app", "--port", str(port),
                            "--index", str(tmp_path / "index")], http_ok(f"http://127.0.0.1:{port}/_stcore/health"),
                           "the app", timeout_s=60, own_session=True,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    health = http_ok(f"http://127.0.0.1:{port}/_stcore/health")

    def answers() -> bool:
        try:
            return health()
        except (OSError, httpx.HTTPError):   # nothing listens
            return False

    try:
        server.process.terminate()   # the CLI's own pid only
        server.process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while answers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not answers(), "the app outlived ragblend app's SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):   # whatever is left of its group
            os.killpg(server.process.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- real browser


def chromium_or_skip() -> tuple[str, str]:
    """Debian's chromium and chromedriver, installed here if missing (the test's set-up)."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        result = subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
                                capture_output=True, text=True, env=env)
        if result.returncode != 0:
            update = subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
            result = subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
                                    capture_output=True, text=True, env=env)
            if result.returncode != 0:
                pytest.skip("Chromium could not be installed with apt-get (chromium, chromium-driver): "
                            + (result.stderr or update.stderr).strip()[-300:])
    pytest.importorskip("selenium")
    return shutil.which("chromium"), shutil.which("chromedriver")


def shown_ratio_in_force(driver) -> float:
    """The ratio the page says the default strategy runs at, checked against the slider's."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    slider = WebDriverWait(driver, 60).until(EC.visibility_of_element_located(
        (By.CSS_SELECTOR, "[data-testid='stSidebar'] [data-testid='stSliderThumbValue']")))
    body = driver.find_element(By.TAG_NAME, "body").text
    # the default model ships its calibration
    in_force = re.search(r"In force by default: QueryAware at ratio (\d\.\d\d), calibrated for this model", body)
    assert in_force, body
    assert slider.text == in_force.group(1)   # the ratio slider's default: the ratio in force
    return float(in_force.group(1))


WAITING = ("Warming up", "chunk(s) from the KV cache…", "Computing a full prefill of")


def record_shown_texts(driver) -> None:
    """Record which of the WAITING texts the page shows from now on, however briefly (a waiting
    indicator lasts until an answer's first token: too short to poll for reliably)."""
    driver.execute_script("""
        const waiting = arguments[0];
        window.shownTexts = {};
        new MutationObserver(() => {
            const text = document.body.innerText;
            for (const wanted of waiting) { if (text.includes(wanted)) window.shownTexts[wanted] = true; }
        }).observe(document.body, {childList: true, subtree: true, characterData: true});""", list(WAITING))


def assert_waiting_was_shown(driver, body: str) -> None:
    """Each answer showed a waiting indicator before its first token (the first question of the
    process: the warm-up's too), gone once it streamed."""
    shown = driver.execute_script("return window.shownTexts")
    assert sorted(shown) == sorted(WAITING), shown
    assert WAITING[1] not in body and WAITING[2] not in body


def assert_ratio_the_right_way_round(driver) -> None:
    """The TTFT ratio as the metric shows it: a slowdown never worded or coloured as a gain."""
    from selenium.webdriver.common.by import By

    metrics = driver.find_elements(By.CSS_SELECTOR, "[data-testid='stMetricValue']")
    fused_s, full_s = (float(m.text.split()[0]) for m in metrics[:2])
    delta = driver.find_element(By.CSS_SELECTOR, "[data-testid='stMetricDelta']")
    red, green = (int(c) for c in re.findall(r"\d+", delta.value_of_css_property("color"))[:2])
    arrow = delta.find_element(By.CSS_SELECTOR, "[data-testid^='stMetricDeltaIcon']").get_attribute("data-testid")
    if delta.text.endswith("x faster"):
        assert fused_s <= full_s and green > red and arrow.endswith("Down"), (delta.text, arrow)
    elif delta.text.endswith("x: slower"):
        assert fused_s >= full_s and red > green and arrow.endswith("Up"), (delta.text, arrow)
    else:
        assert delta.text.endswith("x: as fast"), delta.text
    sentence = re.search(r"Fused \d+\.\d+x(?: faster than|: slower than|: as fast as) full prefill",
                         driver.find_element(By.TAG_NAME, "body").text)
    assert sentence and delta.text.split(": ", 1)[1] in sentence.group(0)   # the caption says the same


def what_the_app_showed(driver, log: Path) -> str:
    """What a timed-out browser test saw: the page's text and the end of the app's output."""
    body = driver.find_element("tag name", "body").text if driver is not None else "(no browser)"
    return f"page text:\n{body[-3000:]}\n--- app output (end):\n{log.read_text(errors='replace')[-3000:]}"


@contextlib.contextmanager
def app_in_browser(tmp_path, env: dict):
    """The app in a streamlit process and a headless Chromium on its page. A wait that times out
    fails with what the page showed and the app's output."""
    chromium, chromedriver = chromium_or_skip()
    from selenium.common.exceptions import TimeoutException

    port = free_port()
    log_path = tmp_path / "app.log"
    with open(log_path, "w") as log:   # a file, not a pipe nobody reads: a full pipe stalls the app
        server = ServerProcess(
            [sys.executable, "-m", "streamlit", "run", APP, "--server.headless", "true", "--server.port", str(port),
             "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
            http_ok(f"http://127.0.0.1:{port}/_stcore/health"), "the app", timeout_s=60,
            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        driver = None
        try:
            driver = headless_chromium(chromium, chromedriver, tmp_path)
            driver.get(f"http://127.0.0.1:{port}")
            yield driver
        except TimeoutException as timeout:
            raise AssertionError(what_the_app_showed(driver, log_path)) from timeout
        finally:
            if driver is not None:
                driver.quit()
            server.stop()


def test_app_in_headless_chromium(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    env = {**os.environ, "RAGBLEND_INDEX_DIR": str(tmp_path / "index"), "RAGBLEND_FILES_ROOT": str(sample_dir())}
    with app_in_browser(tmp_path, env) as driver:
        wait = WebDriverWait(driver, 300)

        def text_input(label):
            return wait.until(EC.element_to_be_clickable(
                (By.XPATH, f"//label[.//p[contains(., '{label}')]]/following::input[1]")))

        def click_button(label):
            wait.until(EC.element_to_be_clickable((By.XPATH, f"//button[.//p[text()='{label}']]"))).click()

        upload = tmp_path / "uploaded-note.md"
        upload.write_text("The old lighthouse keeper of Lowenmark retired in 1968 and moved inland.\n")
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "input[type='file']"))).send_keys(str(upload))
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "uploaded-note.md"))
        folder = text_input("a file or folder on this machine")
        folder.send_keys(str(sample_dir()), Keys.ENTER)
        click_button("Ingest")
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "Ingested 7 file(s)"))

        ratio_in_force = shown_ratio_in_force(driver)

        question = text_input("Question")
        question.send_keys(QUESTION, Keys.ENTER)
        record_shown_texts(driver)
        click_button("Ask")
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "TTFT with fusion"))
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "TTFT over this session"))
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "[data-testid*='VegaLiteChart'] canvas, "
                                                                   "[data-testid*='VegaLiteChart'] svg")))
        time.sleep(1)  # let the chart finish drawing before the screenshot
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "1987" in body
        assert "TTFT with fusion" in body and "TTFT full prefill" in body
        assert_waiting_was_shown(driver, body)
        assert f"Ran query_aware at ratio {ratio_in_force:g}" in body   # the ratio in force ran
        assert_ratio_the_right_way_round(driver)
        shot = tmp_path / "streamlit_app.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000


# ---------------------------------------------------------------------------- hostile uploads and text (issue 58)

OUTSIDE = "127.0.0.1:{port}"   # "the outside address": a server of the test that records every request
HOSTILE_DOC = ('![tracker](http://{outside}/pixel.png) [Click to re-authenticate](http://{outside}/login) '
               '<img src="http://{outside}/raw.png">\n'
               "The Saltwren lighthouse keeper keeps the spare key under the blue stone by the north pier.\n"
               '<a href="http://{outside}/raw">raw link</a> http://{outside}/bare www.example.org '
               ":red[alert] **bold**\n")


def test_refused_uploads_leave_nothing_on_disk(tmp_path, monkeypatch):
    import tempfile

    from tests.robustness import bombs

    scratch = Path(tempfile.gettempdir())
    before = {p for p in scratch.iterdir()}
    at = start_app(monkeypatch, tmp_path / "index")
    at.file_uploader[0].set_value([("bomb.docx", bombs.docx_bomb(400), "application/octet-stream"),
                                   ("pages.pdf", bombs.pdf_bomb(2000, 40), "application/pdf"),
                                   ("huge.md", b"word " * (11 * 2**20 // 5), "text/markdown"),
                                   ("slides.pptx", b"PK\x03\x04", "application/octet-stream"),
                                   ("note.md", b"The ferry leaves the north pier at nine.\n", "text/markdown")])
    button(at, "ingest").click().run()
    assert not at.exception
    warnings = {w.value.split(":", 1)[0]: w.value for w in at.warning}
    assert "expanded\\_mb" in warnings["Skipped bomb.docx"] and "page\\_mb" in warnings["Skipped pages.pdf"]
    assert "over the 10 MB limit" in warnings["Skipped huge.md"]
    assert "unsupported file type" in warnings["Skipped slides.pptx"]
    assert any("Ingested 1 file(s)" in s.value for s in at.success)
    assert not (tmp_path / "index" / "uploads").exists()   # nothing written for any upload, refused or not
    new = [p for p in scratch.iterdir() if p not in before and p.is_file() and not p.is_symlink()]
    assert not [p for p in new if p.stat().st_size < 2**26 and any(
        mark in p.read_bytes() for mark in (b"<w:body>", b"%PDF", b"north pier at nine", b"word word"))]


def test_document_text_is_shown_as_text(tmp_path, monkeypatch):
    """AppTest: the Markdown the page is given for a chunk quotes the document's punctuation."""
    at = start_app(monkeypatch, tmp_path / "index")
    doc = HOSTILE_DOC.format(outside="127.0.0.1:9").encode()
    at.file_uploader[0].set_value([("notes[1](x).md", doc, "text/markdown")])
    button(at, "ingest").click().run()
    at.text_input(key="question").input("Where is the spare key of the lighthouse?")
    button(at, "ask").click().run()
    assert not at.exception
    chunk_lines = [m for m in at.markdown if "(score " in m.value]
    assert chunk_lines and all(m.allow_html and m.value.startswith("<div>") and "\n" not in m.value
                               and "notes[1](x).md" in m.value for m in chunk_lines)   # an HTML block: no Markdown
    shown = " ".join(m.value for m in chunk_lines)
    assert "![tracker](http://127.0.0.1:9/pixel.png)" in shown and "&lt;img src=&quot;http" in shown
    assert "<img" not in shown and "<a " not in shown
    # the answer: an HTML block too, whatever the model wrote
    answers = [m for m in at.markdown if m.value.startswith('<div class="ragblend-text">')]
    assert answers and all(m.allow_html and "\n" not in m.value and "<img" not in m.value for m in answers)
    # file names in alerts: Markdown with its punctuation escaped, autolinks broken by a word joiner
    at.file_uploader[0].set_value([("see www.example.org [x](http:evil).pptx", b"PK", "application/octet-stream")])
    button(at, "ingest").click().run()
    warning = next(w.value for w in at.warning if "pptx" in w.value)
    assert "www\u2060.example.org \\[x\\]\\(http\u2060\\:evil\\).pptx" in warning


@pytest.fixture
def outside_server():
    """A server at "the outside address" recording every request: (its address, the requests)."""
    import http.server
    import threading

    requests = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append((self.path, self.headers.get("Referer")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield OUTSIDE.format(port=server.server_address[1]), requests
    server.shutdown()


def headless_chromium(chromium, chromedriver, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-dev-shm-usage", "--window-size=1400,2400",
                 f"--user-data-dir={tmp_path / 'chrome-profile'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(chromedriver), options=options)


def test_document_markdown_stays_text_in_headless_chromium(tmp_path, outside_server):
    """A document with a Markdown image and link to an outside address, raw HTML and a bare URL:
    the browser shows them as text, makes no <img> or <a> of them, and sends no request there."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    address, requests = outside_server
    env = {**os.environ, "RAGBLEND_INDEX_DIR": str(tmp_path / "index")}
    env.pop("RAGBLEND_FILES_ROOT", None)
    with app_in_browser(tmp_path, env) as driver:
        wait = WebDriverWait(driver, 300)
        upload = tmp_path / "keeper-notes.md"
        upload.write_text(HOSTILE_DOC.format(outside=address))
        hostile_name = tmp_path / "see www.example.org and mail@example.org.pptx"   # refused: its name in a warning
        hostile_name.write_bytes(b"PK")
        wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "input[type='file']"))).send_keys(
            f"{upload}\n{hostile_name}")
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "keeper-notes.md"))
        wait.until(EC.element_to_be_clickable((By.XPATH, "//button[.//p[text()='Ingest']]"))).click()
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "Ingested 1 file(s)"))
        question = wait.until(EC.element_to_be_clickable(
            (By.XPATH, "//label[.//p[contains(., 'Question')]]/following::input[1]")))
        question.send_keys("Where is the spare key of the lighthouse?", Keys.ENTER)
        wait.until(EC.element_to_be_clickable((By.XPATH, "//button[.//p[text()='Ask']]"))).click()
        wait.until(EC.text_to_be_present_in_element((By.TAG_NAME, "body"), "TTFT over this session"))
        for summary in driver.find_elements(By.CSS_SELECTOR, "details summary"):   # open every expander
            if summary.find_element(By.XPATH, "..").get_attribute("open") is None:
                driver.execute_script("arguments[0].click()", summary)
        time.sleep(2)
        body = driver.find_element(By.TAG_NAME, "body").text
        assert f"![tracker](http://{address}/pixel.png)" in body           # the text, shown literally
        assert f"[Click to re-authenticate](http://{address}/login)" in body
        assert f'<img src="http://{address}/raw.png">' in body and ":red[alert] **bold**" in body
        links = [a.get_attribute("href") or "" for a in driver.find_elements(By.TAG_NAME, "a")]
        images = [i.get_attribute("src") or "" for i in driver.find_elements(By.TAG_NAME, "img")]
        assert not [u for u in links + images if address in u or "example.org" in u], (links, images)
        assert not driver.find_elements(By.XPATH, "//a[contains(., 'Click to re-authenticate')]")
        fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert not [u for u in fetched if address in u], fetched
        assert requests == []   # nothing reached the outside address
