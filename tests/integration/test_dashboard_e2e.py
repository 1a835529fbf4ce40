"""
The web dashboard (issue 25) in a real headless browser: Debian's
Chromium driven by Playwright, against a real daemon with real
llama-server children. Sign in with a key; the Models page lists the
generated model; unloading it from the page empties /api/ps; the
Playground streams an answer into the page; a line the engine prints
reaches the Logs page within 2 s; a request queued behind a busy 1-slot
model shows on the Queue page; the Nodes page lists this node, up, with
its loaded model and how to join others; a scoped key sees neither other models nor
the Keys page; the Models page's Pull form pulls from a real distribution
server (Debian's docker-registry on loopback) with its progress shown as it
streams, and shows a refused pull's error; and no page logs a console
error. Each page's screenshot is taken here (into $BLAZAR_SCREENSHOTS when
set: docs/dashboard.md's come from it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from blazar.models import ollama_store as store
from blazar.models.testmodel import make_test_model
from tests.integration.distribution import BlobProxy, DistributionRegistry, seed
from tests.integration.harness import Daemon

ROOT = "root-secret-0123456789"
SCOPED = "scoped-secret-0123456789"
PAGES = ("models", "queue", "nodes", "activity", "logs", "performance", "playground", "sessions", "keys", "engines")


def chromium() -> str:
    found = os.environ.get("BLAZAR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail(
            "the dashboard e2e needs Debian's chromium (sudo apt-get install -y chromium; ./dev.sh test "
            "installs it where it may)"
        )
    return found


@pytest.fixture(scope="module")
def daemon(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ui")
    models = root / "models"
    make_test_model(models / "tiny.gguf")
    make_test_model(models / "other.gguf", seed=3)
    make_test_model(models / "slow.gguf", seed=4, context_length=32768)  # long answers fit
    d = Daemon(
        root,
        (
            f'models_dir = "{models}"\nready_timeout = 60\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\nargs = ["--threads", "1"]\n'
            '[models."slow"]\nparallel = 1\nctx_size = 32768\n'  # one slot, long answers: a queue forms behind it
            "[queue]\ndeadline_normal_secs = 180\n"  # the one behind it waits its turn, however slow the machine
            f'[[keys]]\nname = "root"\nsecret = "{ROOT}"\n'
            f'[[keys]]\nname = "scoped"\nsecret = "{SCOPED}"\nmodels = ["tiny"]\n'
        ),
    )
    d.start()
    yield d
    code = d.stop()
    leftovers = d.leftovers
    d.kill_everything()
    assert code in (0, -signal.SIGTERM), d.log()[-3000:]
    assert leftovers == []


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Page:
    """
    One browser tab on the dashboard, collecting console errors.
    """

    def __init__(self, browser: Any, d: Daemon, shots: Path) -> None:
        self.d, self.shots = d, shots
        self.page = browser.new_page(viewport={"width": 1280, "height": 800})
        self.errors: list[str] = []
        self.page.on(
            "console", lambda m: self.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

    def open(self, page: str = "models") -> None:
        self.page.goto(f"http://127.0.0.1:{self.d.port}/ui#{page}")

    def sign_in(self, secret: str) -> None:
        self.open()
        self.page.fill("#key", secret)
        self.page.click("#signin-form button[type=submit]")
        self.page.wait_for_selector("#nav a[data-page=models].active")

    def go(self, page: str) -> None:
        self.page.click(f"#nav a[data-page={page}]")
        self.page.wait_for_selector(f"#page-{page}:not([hidden])")

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"))


@pytest.fixture()
def shots(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    keep = os.environ.get("BLAZAR_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in tmp_path.glob("*.png"):
            shutil.copy(png, Path(keep) / png.name)


def api(d: Daemon, method: str, path: str, secret: str = ROOT, body: Any = None) -> tuple[int, Any]:
    status, _, raw = d.request(method, path, body, headers={"authorization": f"Bearer {secret}"})
    return status, json.loads(raw) if raw.strip() else None


def test_the_admins_dashboard(daemon: Daemon, browser: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    tab = Page(browser, daemon, shots)
    tab.open()
    tab.page.wait_for_selector("#signin:not([hidden])")
    tab.shot("signin")
    tab.sign_in(ROOT)
    page = tab.page
    expect(page.locator("#files tr[data-model='tiny:latest']")).to_be_visible()
    expect(page.locator("#who")).to_have_text("root (admin)")
    expect(page.locator("#files tr[data-model='tiny:latest']")).to_contain_text("completion")  # its capabilities

    # load it from the page, then unload it from the page: /api/ps is empty
    page.click("#files tr[data-model='tiny:latest'] button.load")
    expect(page.locator("#loaded tr[data-model='tiny:latest']")).to_be_visible(timeout=60000)
    # the GPUs and which one holds the model, or the CPU
    status, models = api(daemon, "GET", "/ui/api/models")
    assert status == 200 and models["gpus"] is not None, models
    if models["gpus"]:
        expect(page.locator("#gpus tr[data-gpu='0']")).to_be_visible(timeout=10000)
    else:
        expect(page.locator("#gpus-none")).to_contain_text("No GPU", timeout=10000)
        expect(page.locator("#loaded tr[data-model='tiny:latest'] td[data-gpus]")).to_have_text("CPU")
    # speculative decoding: off unless the model's table turns it on
    expect(page.locator("#loaded tr[data-model='tiny:latest'] td[data-speculative]")).to_have_text("off")
    tab.shot("models")
    page.click("#loaded tr[data-model='tiny:latest'] button.unload")
    expect(page.locator("#loaded tr[data-model='tiny:latest']")).to_have_count(0, timeout=30000)
    status, ps = api(daemon, "GET", "/api/ps")
    assert status == 200 and ps["models"] == [], ps

    # the Playground streams an answer into the page
    tab.go("playground")
    page.select_option("#chat-model", "tiny:latest")
    page.fill("#chat-system", "You are terse.")
    page.fill("#chat-input", "Say hello.")
    page.click("#chat-send")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s", timeout=60000)
    assert page.locator("#chat-log .msg.assistant").inner_text().strip()
    expect(page.locator("#chat-stats")).to_contain_text("TTFT")
    tab.shot("playground")

    # a line the engine prints reaches the Logs page within 2 s
    tab.go("logs")
    page.select_option("#log-source", "tiny:latest")
    expect(page.locator("#log")).to_contain_text("tiny:latest", timeout=10000)
    before = page.locator("#log div").count()
    sent = time.monotonic()
    status, _ = api(
        daemon,
        "POST",
        "/v1/chat/completions",
        body={"model": "tiny", "messages": [{"role": "user", "content": "one more"}], "max_tokens": 4},
    )
    assert status == 200
    expect(page.locator("#log")).to_contain_text("print_timing", timeout=10000)
    page.locator(f"#log div >> nth={before}").wait_for(timeout=10000)
    assert time.monotonic() - sent < 2.0 + 1.0, "the engine's line took over 2 s to reach the page"  # +1: the request
    tab.shot("logs")

    # a request waiting behind a busy 1-slot model is on the Queue page
    tab.go("queue")
    results: list[int] = []

    def ask(tokens: int) -> None:
        status, _, _ = daemon.request(
            "POST",
            "/v1/chat/completions",
            {
                "model": "slow",
                "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": tokens,
                "ignore_eos": True,
            },
            headers={"authorization": f"Bearer {ROOT}"},
            timeout=120,
        )
        results.append(status)

    status, _ = api(daemon, "POST", "/ui/api/models/slow/load")
    assert status == 200
    busy = threading.Thread(target=ask, args=(6000,))  # a few seconds even at 5000 tokens/s
    busy.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, queue = api(daemon, "GET", "/api/queue")
        slow = [m for m in queue["models"] if m["model"] == "slow:latest"]
        if slow and slow[0]["slots"]["busy"] == 1:
            break
        time.sleep(0.05)
    waiting = threading.Thread(target=ask, args=(4,))
    waiting.start()
    deadline = time.monotonic() + 10
    seen_waiting = False
    while time.monotonic() < deadline and not seen_waiting:  # the gateway has it waiting...
        _, queue = api(daemon, "GET", "/api/queue")
        seen_waiting = any(m["model"] == "slow:latest" and m["waiting"]["total"] == 1 for m in queue["models"])
        time.sleep(0.05)
    assert seen_waiting, ("the second request never waited", results, queue)
    # ...and the page shows it (it polls every second)
    expect(page.locator(".queue-model[data-model='slow:latest'] tr.waiting")).to_have_count(1, timeout=10000)
    expect(page.locator(".queue-model[data-model='slow:latest'] tr.running")).to_have_count(1)
    tab.shot("queue")
    busy.join(120)
    waiting.join(120)
    assert results == [200, 200], results

    # the Activity page lists those requests, the Performance page draws the hour
    tab.go("activity")
    expect(page.locator("#activity tbody tr").first).to_be_visible(timeout=10000)
    expect(page.locator("#activity")).to_contain_text("slow:latest")
    tab.shot("activity")
    # a `blazar bench` run (through the gateway, with the admin key) shows under the charts
    import subprocess
    import sys

    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "blazar"),
            "bench",
            "tiny",
            "--concurrency",
            "1",
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "4",
            "--rounds",
            "1",
            "--key",
            ROOT,
            "-c",
            str(daemon.config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    tab.go("performance")
    expect(page.locator("#chart-tokens rect.bar1").first).to_be_visible(timeout=15000)
    expect(page.locator("#chart-latency rect.bar2").first).to_be_visible()  # p95 beside p50
    expect(page.locator(".bench-model[data-model='tiny:latest'] tbody tr")).to_have_count(1, timeout=15000)
    expect(page.locator("#bench-empty")).to_be_hidden()
    tab.shot("performance")
    # the Nodes page: this node alone (no [cluster] database), up, with what it runs, and how to join others
    tab.go("nodes")
    expect(page.locator("#nodes tr[data-node][data-state=up]")).to_have_count(1, timeout=10000)
    expect(page.locator("#nodes tr[data-node] tr[data-model='slow:latest']")).to_be_visible(timeout=15000)
    expect(page.locator("#nodes-hint")).to_contain_text("[cluster] database")
    tab.shot("nodes")
    for name in ("sessions", "engines"):
        tab.go(name)
        page.wait_for_timeout(500)
        tab.shot(name)

    # keys: add one (its secret shown once), rotate it, remove it
    tab.go("keys")
    expect(page.locator("#keys tr[data-key=root]")).to_be_visible()
    page.fill("#key-name", "ui-made")
    page.fill("#key-models", "tiny")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-secret")).to_contain_text("blz-", timeout=10000)
    expect(page.locator("#keys tr[data-key=ui-made]")).to_be_visible()
    tab.shot("keys")
    secret = page.locator("#key-secret").inner_text().split(": ")[-1].strip()
    status, _ = api(daemon, "GET", "/v1/models", secret=secret)
    assert status == 200, "the key the page made does not work"
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#keys tr[data-key=ui-made] button >> text=Remove")
    expect(page.locator("#keys tr[data-key=ui-made]")).to_have_count(0, timeout=10000)
    assert tab.errors == [], tab.errors
    status, _, metrics = daemon.request("GET", "/metrics", headers={"authorization": f"Bearer {ROOT}"})
    assert b'blazar_requests_total{key="root",model="",status="2xx",surface="ui"}' in metrics  # its own requests too


def test_a_scoped_key_sees_its_models_and_no_admin_pages(daemon: Daemon, browser: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    tab = Page(browser, daemon, shots)
    tab.sign_in(SCOPED)
    page = tab.page
    expect(page.locator("#files tr[data-model='tiny:latest']")).to_be_visible()
    expect(page.locator("#files tbody tr")).to_have_count(1)  # not other, not slow
    expect(page.locator("#who")).to_have_text("scoped")
    expect(page.locator("#nav a[data-page=keys]")).to_be_hidden()
    expect(page.locator("#nav a[data-page=engines]")).to_be_hidden()
    expect(page.locator("#files button.load")).to_have_count(0)  # no admin actions
    tab.open("keys")  # typed into the address bar: the page falls back to Models
    expect(page.locator("#page-models")).to_be_visible()
    expect(page.locator("#page-keys")).to_be_hidden()
    tab.shot("scoped")
    assert tab.errors == [], tab.errors
    for path in ("/ui/api/keys", "/ui/api/engines", "/ui/api/performance", "/ui/api/bench", "/api/logs"):
        status, body = api(daemon, "GET", path, secret=SCOPED)
        assert status == 403, (path, body)
    status, body = api(daemon, "GET", "/api/logs?model=tiny", secret=SCOPED)
    lines = [line["text"] for line in body["lines"]]
    # Blazar's own lines about its model; never the engine's raw output (other keys' schemas and
    # answers: issue 36), nor request lines, nor paths
    assert lines and not any(t.startswith("tiny:latest | ") for t in lines), lines[:5]
    assert any("tiny:latest" in t for t in lines), lines[:5]
    assert not any(str(daemon.root) in t or "key=" in t for t in lines), "paths or other keys' requests"
    status, body = api(daemon, "GET", "/api/logs?model=tiny", secret=ROOT)
    assert any(line["text"].startswith("tiny:latest | ") for line in body["lines"])  # an admin sees the engine
    status, body = api(daemon, "GET", "/ui/api/models", secret=SCOPED)
    assert [f["name"] for f in body["files"]] == ["tiny:latest"], body
    status, body = api(daemon, "POST", "/ui/api/models/tiny/unload", secret=SCOPED)
    assert status == 403, body


@pytest.fixture()
def library(tmp_path: Path) -> Iterator[BlobProxy]:
    """
    A distribution server holding C{library/small:latest} (a generated model
    of about 9 MB: several progress lines, one per MiB), behind the blob
    proxy (L{BlobProxy}), which can slow its blobs.
    """
    registry = DistributionRegistry(tmp_path / "registry")
    proxy = BlobProxy(registry.url)
    try:
        model = make_test_model(tmp_path / "seed" / "small.gguf", seed=21, n_embd=256, n_ff=1024).path
        seed(registry.url, "library/small", "latest", [(store.MEDIA_MODEL, model.read_bytes())])
        yield proxy
    finally:
        proxy.close()
        registry.close()


def test_the_pull_form(engine: str, library: BlobProxy, browser: Any, shots: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    root = tmp_path / "daemon"
    (root / "models").mkdir(parents=True)
    d = Daemon(
        root,
        (
            f'models_dir = "{root / "models"}"\nollama_models = "{root / "store"}"\nregistry = "{library.url}"\n'
            f'[engines.llamacpp]\nbinary = "{engine}"\n'
            f'[[keys]]\nname = "root"\nsecret = "{ROOT}"\n'
            f'[[keys]]\nname = "scoped"\nsecret = "{SCOPED}"\nmodels = ["small"]\n'
        ),
    )
    d.start()
    try:
        tab = Page(browser, d, shots)
        tab.sign_in(ROOT)
        page = tab.page
        expect(page.locator("#pull-form")).to_be_visible()
        expect(page.locator("#files tbody tr")).to_have_count(0)
        # every text the progress line shows, as the page sets it
        page.evaluate("""() => {
          window.pullSeen = [];
          new MutationObserver((records) => records.forEach((r) => r.addedNodes.forEach(
            (n) => window.pullSeen.push(n.textContent)))).observe(document.getElementById("pull-status"),
            { childList: true });
        }""")
        library.rate = 3 << 20  # bytes a second: the pull takes about 3 s, so the page shows it under way
        page.fill("#pull-name", "small")
        page.click("#pull-send")
        # a blob's percentage while the pull is still streaming
        expect(page.locator("#pull-status")).to_have_text(
            re.compile(r"pull small: pulling [0-9a-f]{12}: [1-9][0-9]?% \("), timeout=30000
        )
        expect(page.locator("#pull-status")).to_have_text("pull small: success", timeout=60000)
        expect(page.locator("#pull-status")).to_have_class("muted")
        # the list is refreshed on success, without waiting for the page's next poll
        expect(page.locator("#files tr[data-model='small:latest']")).to_be_visible(timeout=1500)
        expect(page.locator("#pull-send")).to_be_enabled()
        expect(page.locator("#pull-name")).to_have_value("")
        seen = page.evaluate("window.pullSeen")
        assert seen[:2] == ["pull small: starting", "pull small: pulling manifest"], seen
        assert seen[-3:] == [
            "pull small: verifying sha256 digest",
            "pull small: writing manifest",
            "pull small: success",
        ], seen
        blobs = [t for t in seen if re.fullmatch(r"pull small: pulling [0-9a-f]{12}: \d+% \(.*\)", t)]
        assert any(" 100% " in t for t in blobs) and len(blobs) >= 4, seen  # 0%, each MiB, 100%
        status, tags = api(d, "GET", "/api/tags")
        assert status == 200 and [m["name"] for m in tags["models"]] == ["small:latest"], tags
        tab.shot("pull")

        # a name the registry does not hold: an error line in the stream, shown as an error
        library.rate = None
        page.fill("#pull-name", "missing:1")
        page.click("#pull-send")
        expect(page.locator("#pull-status")).to_contain_text(
            "pull missing:1: pull model manifest: file does not exist", timeout=30000
        )
        expect(page.locator("#pull-status")).to_have_class("error")
        expect(page.locator("#pull-name")).to_have_value("missing:1")  # kept, to be corrected
        # a name refused before any line (a plain 400 answer), shown the same way
        page.fill("#pull-name", "a/b/c/d")
        page.click("#pull-send")
        expect(page.locator("#pull-status")).to_contain_text("pull a/b/c/d: ", timeout=30000)
        expect(page.locator("#pull-status")).to_have_class("error")
        expect(page.locator("#pull-status")).not_to_contain_text("pulling manifest")
        expect(page.locator("#files tbody tr")).to_have_count(1)
        # the browser's own note of the 400; nothing else
        assert all("Failed to load resource" in e and "status of 400" in e for e in tab.errors), tab.errors

        # a scoped key has no Pull form (its pulls are refused: management is the admin's)
        scoped = Page(browser, d, shots)
        scoped.sign_in(SCOPED)
        expect(scoped.page.locator("#files tr[data-model='small:latest']")).to_be_visible()
        expect(scoped.page.locator("#pull-form")).to_be_hidden()
        assert scoped.errors == [], scoped.errors
        status, body = api(d, "POST", "/api/pull", secret=SCOPED, body={"model": "small"})
        assert status == 403, body
    finally:
        d.close()


def test_security_headers_and_the_keyless_door(daemon: Daemon) -> None:
    status, headers, page = daemon.request("GET", "/ui")
    assert status == 200 and b"<script" in page and b"<script>" not in page  # no inline script
    csp = headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe" not in csp, csp
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    status, headers, _ = daemon.request("GET", "/ui/api/models")
    assert status == 401  # the data needs the key; the page does not
    status, headers, _ = daemon.request("GET", "/", headers={"accept": "text/html"})
    assert status == 302 and headers["location"] == "/ui"
    status, _, body = daemon.request("GET", "/")
    assert status == 200 and b"Ollama is running" in body  # Ollama clients still get their line


def test_blazar_logs_follow_reads_the_same_stream(daemon: Daemon) -> None:
    import subprocess
    import sys

    status, _ = api(
        daemon,
        "POST",
        "/v1/chat/completions",
        body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert status == 200
    follow = subprocess.Popen(
        [str(Path(sys.executable).parent / "blazar"), "logs", "tiny", "-f", "-c", str(daemon.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "BLAZAR_API_KEY": ROOT},
    )
    try:
        first = follow.stdout.readline() if follow.stdout is not None else ""
        assert "tiny:latest" in first, (
            first,
            follow.stderr.read() if follow.poll() is not None and follow.stderr else "",
        )
        status, _ = api(
            daemon,
            "POST",
            "/v1/chat/completions",
            body={"model": "tiny", "messages": [{"role": "user", "content": "again"}], "max_tokens": 2},
        )
        assert status == 200
        deadline = time.monotonic() + 10
        seen = ""
        while "print_timing" not in seen and time.monotonic() < deadline:
            seen += follow.stdout.readline() if follow.stdout is not None else ""
        assert "print_timing" in seen, seen[-2000:]
    finally:
        follow.kill()
        follow.wait(10)
    deadline = time.monotonic() + 10  # it followed the HTTP stream (its access line: the stream ended)
    while "GET /api/logs" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "GET /api/logs" in daemon.log()


def test_a_keyless_gateway_takes_no_orders_from_other_sites(engine: str, tmp_path: Path) -> None:
    # no keys: management from this machine only, and a web page on it is not the user
    make_test_model(tmp_path / "models" / "tiny.gguf")
    d = Daemon(tmp_path, f'models_dir = "{tmp_path / "models"}"\n[engines.llamacpp]\nbinary = "{engine}"\n')
    d.start()
    try:
        forged = {"origin": "https://evil.example", "content-type": "text/plain"}
        status, _, body = d.request("POST", "/ui/api/keys", raw=b'{"name": "csrf"}', headers=forged)
        assert status == 403 and b"evil.example" in body, body
        status, _, body = d.request("POST", "/ui/api/models/tiny/load", headers={"origin": "null"})
        assert status == 403, body
        status, _, body = d.request("GET", "/ui/api/models", headers={"host": f"rebound.example:{d.port}"})
        assert status == 403 and b"rebound.example" in body, body  # a DNS-rebinding page's read
        status, _, body = d.request("POST", "/api/pull", {"model": "x"}, headers={"origin": "https://evil.example"})
        assert status == 403, body  # Ollama's management too
        status, _, body = d.request("GET", "/ui/api/models")
        assert status == 200 and b"tiny:latest" in body  # this machine's own tools
        assert "[[keys]]" not in (tmp_path / "config.toml").read_text()
    finally:
        d.close()
