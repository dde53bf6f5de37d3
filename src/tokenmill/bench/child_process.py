"""What `tokenmill bench` hands the processes it spawns (one per backend or model, so their GPU memory never
mixes): this copy of tokenmill first on their path, and a preset's model directory made in one of its own."""
from __future__ import annotations

import os
import subprocess
import sys


def preset_dtype(dtype: str) -> str:
    return "bfloat16" if dtype in ("auto", None) else dtype


def child_env() -> dict:
    """This process's environment, with this copy of tokenmill first on the path of child processes."""
    env = dict(os.environ)
    src_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    return env


def materialise(args) -> str:
    """Resolve a preset in a separate process, so this one never holds GPU memory."""
    from tokenmill.models.presets import is_preset, resolve_model_path

    if not is_preset(args.model):
        return args.model
    if args.in_process:
        return resolve_model_path(args.model, preset_dtype(args.dtype), args.seed)
    out = subprocess.run([sys.executable, "-m", "tokenmill.bench", "prepare", "--model", args.model,
                          "--seed", str(args.seed), "--dtype", preset_dtype(args.dtype)],
                         stdout=subprocess.PIPE, text=True, check=True, env=child_env())
    return out.stdout.strip().splitlines()[-1]
