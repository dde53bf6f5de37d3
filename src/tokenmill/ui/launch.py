"""`tokenmill ui`: run the Chainlit app in a child process, pointed at a tokenmill (or any OpenAI) server."""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile

from tokenmill.ui.chat import UISettings, allowed_hosts

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.py")
PR_SET_PDEATHSIG = 1   # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def add_ui_args(p: argparse.ArgumentParser):
    d = UISettings()
    p.add_argument("--base-url", default=d.base_url, help="the server's OpenAI base URL (ending in /v1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: "
                   "$TOKENMILL_UI_API_KEY, which keeps the key out of the process list)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="another host name the page may be reached by (a LAN address, a proxy's name; "
                   "repeatable; '*': any, which lets DNS rebinding through). Always allowed: localhost, "
                   "127.0.0.1, ::1 and --host unless it is 0.0.0.0 or ::")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--history-messages", type=int, default=d.history_messages,
                   help="chat messages sent with each request (older ones are dropped)")
    p.add_argument("--app-root", default=None,
                   help="folder for Chainlit's .chainlit/ and .files/ (default: a fresh temporary folder)")


def run_ui(args) -> int:
    if importlib.util.find_spec("chainlit") is None:   # importing chainlit would write .files/ into the cwd
        print("tokenmill ui needs Chainlit: pip install 'tokenmill[ui]'", file=sys.stderr)
        return 1
    settings = UISettings(base_url=args.base_url, api_key=args.api_key, max_tokens=args.max_tokens,
                          temperature=args.temperature, history_messages=args.history_messages,
                          allowed_hosts=allowed_hosts(args.host, args.allowed_host))
    try:
        settings.check()
    except ValueError as e:
        print(f"tokenmill ui: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tokenmill-ui-") as tmp:
        # Chainlit writes its config and uploads under the app root; keep them out of the user's cwd. The
        # child runs in it, so a relative path is made absolute first.
        root = os.path.abspath(args.app_root or tmp)
        try:
            write_config(root)
        except OSError as e:
            print(f"tokenmill ui: cannot use --app-root {args.app_root!r}: {e}", file=sys.stderr)
            return 2
        env = dict(os.environ, CHAINLIT_APP_ROOT=root, **settings.to_env())
        cmd = [sys.executable, "-m", "chainlit", "run", APP, "--headless", "--host", args.host,
               "--port", str(args.port)]
        print(f"tokenmill ui on http://{args.host}:{args.port} -> {args.base_url}", flush=True)
        proc = subprocess.Popen(cmd, env=env, cwd=root, preexec_fn=_child_setup(os.getpid()))
        return _wait_forwarding(proc)


# Chainlit's settings where the app root has none of its own: messages cannot be edited (the chat's history
# is the app's, which an edit in the page would not cut) and files cannot be attached (the app sends text
# only, so an attachment would be dropped unseen). No origin gets CORS headers: the page is served by the UI
# itself, and Chainlit's default ("*", with credentials) lets any site's script read the UI's replies.
CONFIG = """[meta]
generated_by = "2.12.0"

[project]
allow_origins = []

[features]
edit_message = false

[features.spontaneous_file_upload]
enabled = false

[UI]
name = "tokenmill"
"""


def write_config(root: str) -> None:
    """`CONFIG` as `root`'s .chainlit/config.toml, unless the folder has one."""
    path = os.path.join(root, ".chainlit", "config.toml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(CONFIG)


def _child_setup(parent_pid: int):
    """What the child runs between fork and exec. Its own process group, so a terminal's Ctrl-C reaches only
    the parent, which forwards it once; and on Linux SIGTERM as soon as the parent dies, however it dies
    (SIGKILL included), so the page never outlives `tokenmill ui`."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def setup():   # after fork: no imports or allocations beyond the call itself
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
            if os.getppid() != parent_pid:   # the parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)
    return setup


def _wait_forwarding(proc: subprocess.Popen) -> int:
    """Wait for the child, passing SIGTERM and SIGINT on to it, and return its status (128 + N for a signal
    N, as a shell reports it)."""
    def forward(signum, _frame):
        proc.send_signal(signum)   # a no-op once the child has been reaped
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - rc if rc < 0 else rc
