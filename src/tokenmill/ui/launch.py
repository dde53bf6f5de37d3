"""`tokenmill ui`: run the Chainlit app in a child process, pointed at a tokenmill (or any OpenAI) server."""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

from tokenmill.ui.chat import UISettings

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.py")


def add_ui_args(p: argparse.ArgumentParser):
    d = UISettings()
    p.add_argument("--base-url", default=d.base_url, help="the server's OpenAI base URL (ending in /v1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
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
                          temperature=args.temperature, history_messages=args.history_messages)
    with tempfile.TemporaryDirectory(prefix="tokenmill-ui-") as tmp:
        # Chainlit writes its config and uploads under the app root; keep them out of the user's cwd
        root = args.app_root or tmp
        env = dict(os.environ, CHAINLIT_APP_ROOT=root, **settings.to_env())
        cmd = [sys.executable, "-m", "chainlit", "run", APP, "--headless", "--host", args.host,
               "--port", str(args.port)]
        print(f"tokenmill ui on http://{args.host}:{args.port} -> {args.base_url}", flush=True)
        proc = subprocess.Popen(cmd, env=env, cwd=root)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return proc.wait()
