"""The page at `/` in a real headless Chromium (Debian's `chromium` and `chromium-driver`, driven by selenium), each test
against its own server (`python -m llm_engine.web` over a tiny random model).

Screenshots (1280x800) go to $LLM_ENGINE_SCREENSHOTS when it is set (`LLM_ENGINE_SCREENSHOTS=nbs/images` refreshes the
book's), else to a temporary folder."""
import json, os, re, shutil, sys, tempfile, threading, time
from pathlib import Path
import httpx, pytest
from llm_engine.testing import ServerProcess, make_tiny_model

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = ("--headless=new --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking "
         "--disable-component-update --disable-sync --disable-dev-shm-usage --window-size=1280,800").split()

@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model(Path(tempfile.gettempdir()) / "llm_engine_tiny_web")

@pytest.fixture(scope="module")
def browser():
    for p in (CHROMIUM, CHROMEDRIVER):   # not a skip: the suite needs them (apt-get install -y chromium chromium-driver)
        if not Path(p).exists(): pytest.fail(f"{p} not found: apt-get install -y chromium chromium-driver (or set CHROMIUM / CHROMEDRIVER)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="llm_engine_chromium_")
    o = webdriver.ChromeOptions(); o.binary_location = CHROMIUM
    for f in FLAGS + [f"--user-data-dir={profile}"]: o.add_argument(f)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=o, service=Service(CHROMEDRIVER))
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    yield d
    d.quit(); shutil.rmtree(profile, ignore_errors=True)

def start(tiny, *args):
    return ServerProcess([sys.executable, "-m", "llm_engine.web", "--port", "{port}", "--model", str(tiny), "--dtype", "float32",
                          "--log-level", "warning", *args], timeout=240, capture_output=True)

@pytest.fixture
def server(tiny, browser):
    with start(tiny, "--num-blocks", "256", "--max-num-seqs", "8", "--web-interval", "0.1") as s:   # 10 frames a second
        yield s
        browser.get("about:blank")                  # the page leaves before its server stops

def wait_for(fn, what, timeout=30.0, every=0.1):
    "The first truthy value of `fn()`; fails naming `what` after `timeout` s."
    deadline = time.time() + timeout
    while time.time() < deadline:
        if v := fn(): return v
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")

def by_id(d, i): return d.find_element("id", i)
def text(d, i): return by_id(d, i).text
def errors(d): return [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
def stats(srv, **kw): return httpx.get(srv.base + "/v1/stats", **kw).json()

def shot(d, name):
    out = Path(os.environ.get("LLM_ENGINE_SCREENSHOTS") or tempfile.gettempdir())
    out.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(out / f"web_{name}.png"))
    return out / f"web_{name}.png"

def open_page(d, srv):
    d.get("about:blank"); d.get_log("browser")       # the last test's page (its server gone) says nothing more here
    d.get(srv.base + "/")
    wait_for(lambda: text(d, "state-status").startswith("live"), "the state stream")
    wait_for(lambda: "blocks used" in text(d, "blocks-caption"), "the first frame")

def set_field(d, i, value):
    by_id(d, "settings").get_attribute("open") or d.find_element("css selector", "#settings summary").click()
    el = by_id(d, i); el.clear(); el.send_keys(str(value))

def ask(d, message, max_tokens=None):
    "Type `message` (newlines as Shift+Enter), press Enter; returns the assistant bubble."
    from selenium.webdriver.common.keys import Keys
    if max_tokens: set_field(d, "max-tokens", max_tokens)
    n = len(d.find_elements("css selector", ".msg.assistant"))
    box = by_id(d, "prompt"); box.click()
    for i, line in enumerate(message.split("\n")):
        if i: box.send_keys(Keys.SHIFT, Keys.ENTER)
        box.send_keys(line)
    box.send_keys(Keys.ENTER)
    return wait_for(lambda: d.find_elements("css selector", ".msg.assistant")[n:] and d.find_elements("css selector", ".msg.assistant")[n],
                    "the answer's bubble")

def test_page_loads_without_console_errors(browser, server):
    r = httpx.get(server.base + "/")
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    open_page(browser, server)
    assert "llm_engine_tiny_web" in wait_for(lambda: text(browser, "model-name"), "the model's name")
    assert text(browser, "blocks-caption").startswith("0 of 256 blocks used")
    assert int(by_id(browser, "blockmap").get_attribute("data-cells")) == 256
    assert errors(browser) == []

def test_chat_answer_streams_in(browser, server):
    open_page(browser, server)
    browser.execute_script("""               // every render of the answer, however fast it streams
        window.renders = [];
        new MutationObserver(() => { const b = [...document.querySelectorAll('.msg.assistant .body')].pop();
                                     if (b) window.renders.push([b.parentNode.dataset.state, b.textContent]); })
          .observe(document.getElementById('messages'), {childList: true, subtree: true, attributes: true});""")
    m = ask(browser, "first line\nsecond line", max_tokens=96)
    assert browser.find_elements("css selector", ".msg.user")[-1].text == "first line\nsecond line"   # Shift+Enter: a newline
    wait_for(lambda: m.get_attribute("data-state") == "done", "the whole answer", 120)
    final = browser.execute_script("return document.querySelector('.msg.assistant:last-child .body').textContent")
    partial = list(dict.fromkeys(t for state, t in browser.execute_script("return window.renders") if state == "streaming" and t))
    assert len(partial) >= 2 and all(final.startswith(t) for t in partial), partial            # it grew, piece by piece
    assert re.search(r"(length|stop) · \d+ tokens", m.find_element("css selector", ".meta").text)
    assert errors(browser) == []

def test_stop_aborts_the_request_on_the_server(browser, server):
    open_page(browser, server)
    m = ask(browser, "Tell me a long story.", max_tokens=1500)
    wait_for(lambda: len(m.find_element("css selector", ".body").text) > 40, "some streamed text")
    assert stats(server)["requests_running"] == 1 and stats(server)["kv_blocks_used"] > 0
    by_id(browser, "stop").click()
    wait_for(lambda: m.get_attribute("data-state") == "stopped", "the answer marked stopped")
    wait_for(lambda: (s := stats(server))["requests_running"] == 0 and s["kv_blocks_used"] == 0, "the request's blocks back", 10)
    done = stats(server)["tokens_generated"]
    assert done < 1500
    time.sleep(1.0)
    assert stats(server)["tokens_generated"] == done       # nothing more is computed for it
    assert text(browser, "count-running") == "0"

def client(base, i, system, results):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
            "max_tokens": 400 + 8 * i, "ignore_eos": True, "stream": True}     # long enough to be running still when clicked on a fast machine
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        results[i] = sum(1 for l in r.iter_lines() if l.startswith("data: {"))

def click_fresh(browser, css, tries=40):
    "Click the element `css` finds; a request that moves between queues gets a new button there, so a found one can go stale before the click."
    from selenium.common.exceptions import StaleElementReferenceException
    for _ in range(tries):
        try: browser.find_element("css selector", css).click(); return
        except StaleElementReferenceException: time.sleep(0.05)
    raise AssertionError(f"{css} was redrawn before every one of {tries} clicks landed")

def test_sixteen_clients_in_the_engine_view(browser, server):
    open_page(browser, server)
    system = "You are a careful assistant who answers arithmetic questions with one number. " * 3   # shared prefix blocks
    results, seen = {}, []
    threads = [threading.Thread(target=client, args=(server.base, i, system, results)) for i in range(16)]
    for t in threads: t.start()
    def look():
        cv = by_id(browser, "blockmap")
        return dict(running=int(text(browser, "count-running")), waiting=int(text(browser, "count-waiting")),
                    used=int(cv.get_attribute("data-used")), shared=int(cv.get_attribute("data-shared")))
    busy = wait_for(lambda: (v := look())["running"] and v["waiting"] and v["used"] and v, "running and waiting requests", 60)
    time.sleep(1.0); shot(browser, "engine")                                   # a second on: a fuller map
    click_fresh(browser, "#q-running button.req")     # a request's trace, its blocks highlighted
    wait_for(lambda: text(browser, "trace-body").startswith("request chatcmpl-"), "the running request's trace")
    wait_for(lambda: int(by_id(browser, "blockmap").get_attribute("data-selected")) > 0, "its blocks highlighted")
    shot(browser, "trace")
    while any(t.is_alive() for t in threads): seen.append(look()); time.sleep(0.2)
    for t in threads: t.join()
    assert len(results) == 16 and all(n > 0 for n in results.values()), results
    assert busy["running"] <= 8 and busy["running"] + busy["waiting"] <= 16 and busy["used"] > 0
    assert max(v["shared"] for v in seen + [busy]) > 0, "the common system prompt's blocks were never shown shared"
    wait_for(lambda: look() == dict(running=0, waiting=0, used=0, shared=0), "every block free on the page")
    assert text(browser, "blocks-caption").startswith("0 of 256 blocks used")
    assert stats(server)["kv_blocks_used"] == 0
    assert len(browser.find_elements("css selector", "#q-recent button.req")) == 12      # the last finished, clickable
    assert errors(browser) == []

def test_trace_opens_on_click(browser, server):
    open_page(browser, server)
    first = ask(browser, "Hello!", max_tokens=12)
    wait_for(lambda: first.get_attribute("data-state") == "done", "the first answer")
    m = ask(browser, "And again?", max_tokens=12)
    wait_for(lambda: m.get_attribute("data-state") == "done", "the answer")
    link = m.find_element("css selector", ".trace-link")
    rid, rid0 = link.get_attribute("data-request-id"), first.find_element("css selector", ".trace-link").get_attribute("data-request-id")
    link.click()
    wait_for(lambda: f"request {rid}:" in text(browser, "trace-body"), "the trace in words")
    assert "finished at step" in text(browser, "trace-body") and text(browser, "trace-title") == rid
    b = wait_for(lambda: browser.find_elements("css selector", f"#q-recent button.req[data-request-id='{rid0}']"), "the first request listed")[0]
    time.sleep(1.0)                                 # ten frames later the finished list still holds the same button:
    b.click()                                       # frames update it in place (a redrawn one would raise stale here)
    wait_for(lambda: text(browser, "trace-title") == rid0 and f"request {rid0}:" in text(browser, "trace-body"), "the trace from the finished list")
    assert "selected" in b.get_attribute("class")
    shot(browser, "chat")
    assert errors(browser) == []

XSS = "<img src=x onerror=alert(1)>"

def test_markup_is_shown_as_text(browser, server):
    from selenium.common.exceptions import NoAlertPresentException
    open_page(browser, server)
    set_field(browser, "system", XSS)
    m = ask(browser, XSS, max_tokens=8)
    wait_for(lambda: m.get_attribute("data-state") == "done", "the answer")
    assert browser.find_elements("css selector", ".msg.user")[-1].text == XSS
    # the model's side: the Markdown renderer given the same text, and a script in a code block
    html = browser.execute_async_script("""
        const done = arguments[arguments.length - 1], src = arguments[0];
        import('/static/markdown.js').then(({renderMarkdown}) => {
          const div = document.createElement('div');
          renderMarkdown(src + ' **bold** `x`\\n```\\n<script>alert(2)</script>\\n```', div);
          done([div.querySelectorAll('img, script').length, div.querySelectorAll('strong, code, pre').length, div.textContent]);
        }).catch((e) => done(String(e)));""", XSS)
    assert html[0] == 0 and html[1] == 4 and XSS in html[2] and "<script>alert(2)</script>" in html[2]
    assert browser.find_elements("css selector", "#messages img, #messages script") == []
    with pytest.raises(NoAlertPresentException): browser.switch_to.alert.text
    assert errors(browser) == []

def test_api_key_typed_once(browser, tiny):
    with start(tiny, "--num-blocks", "64", "--api-key", "sesame") as srv:
        assert httpx.get(srv.base + "/v1/debug/state?frames=1").status_code == 401
        browser.get("about:blank"); browser.get(srv.base + "/")
        wait_for(lambda: text(browser, "key-status") == "this server needs an API key", "the page asking for the key")
        assert "needs the API key" in text(browser, "state-status")
        by_id(browser, "api-key").send_keys("sesame"); by_id(browser, "key-use").click()
        wait_for(lambda: text(browser, "state-status").startswith("live"), "the state stream with the key")
        assert browser.execute_script("return sessionStorage.getItem('llm_engine_api_key')") == "sesame"
        browser.refresh()                                     # kept for the tab: not typed again
        open_page(browser, srv)
        assert "llm_engine_tiny_web" in wait_for(lambda: text(browser, "model-name"), "the model's name")
        m = ask(browser, "Hi", max_tokens=6)
        wait_for(lambda: m.get_attribute("data-state") == "done", "an answer with the key")
        assert re.search(r"\d+ tokens", m.find_element("css selector", ".meta").text)
        browser.get("about:blank")

def test_settings_reach_the_server(browser, server):
    open_page(browser, server)
    set_field(browser, "schema", '{"type": "string", "enum": ["yes", "no"]}')   # structured output: one of two JSON strings
    m = ask(browser, "Yes or no?", max_tokens=16)
    wait_for(lambda: m.get_attribute("data-state") == "done", "the constrained answer")
    assert m.find_element("css selector", ".body").text in ('"yes"', '"no"'), m.text
    set_field(browser, "schema", "{not json")
    m = ask(browser, "Again?")
    wait_for(lambda: "not valid JSON" in m.text, "the page refusing a bad schema")
    set_field(browser, "schema", "")
    set_field(browser, "tools", '{"type": "function"}')
    m = ask(browser, "Call something.")
    wait_for(lambda: "must be a JSON array" in m.text, "the page refusing tools that are not a list")
    set_field(browser, "tools", '[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]')
    m = ask(browser, "Add 2 and 3.", max_tokens=8)
    wait_for(lambda: m.get_attribute("data-state") == "done", "an answer with tools given")
    assert errors(browser) == []
