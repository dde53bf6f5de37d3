"""One markdown row of a batch-1 latency comparison (ab_latency.sh, env_ab.sh): model, run, label (a commit
or the run's settings), the engine's ms per step, the decode graph's replay ms and their difference, and the
SM clock and temperature while the graph replayed, read from the profile_decode.py JSON in DIR; FAILED when
the run left none.

Usage: python scripts/device/latency_row.py DIR MODEL RUN LABEL
"""
import glob
import json
import sys

d, model, run, label = sys.argv[1:]
found = glob.glob(f"{d}/profile_*.json")
if not found:
    print(f"| {model} | {run} | {label} | FAILED | | | |")
else:
    r = json.load(open(found[0]))["decode"][0]
    gpu = r.get("gpu", {})
    state = f"{gpu['sm_mhz']:.0f} MHz, {gpu['temp_c']:.0f} C" if "sm_mhz" in gpu else "-"
    print(f"| {model} | {run} | {label} | {r['step_ms']:.3f} | {r['graph_replay_ms']:.3f} | "
          f"{1e3 * (r['step_ms'] - r['graph_replay_ms']):.0f} | {state} |")
