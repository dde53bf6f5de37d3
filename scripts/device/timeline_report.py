"""Reads a timeline written by `profile_decode.py --timeline` and prints where a decode step's time goes.

Graph replay: each kernel's role (per decoder layer, by position around the attention kernel: at batch 1
the product before attention, attention, the products after it; at larger batches, whose layers run more
kernels, each kernel's place after the attention kernel and its name), its mean duration, and its mean
increment: how far it moves the end of the work done so far (end minus the latest end before it), so
the increments add up to the replay's span and overlapped work counts once. Steps: the events between
two graph replays (copies, the sampler's kernels) and the gaps between them.

Usage: python scripts/device/timeline_report.py timeline_qwen3-4b.json
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

ATTENTION = "_fused_decode_kernel"
AFTER = ["o_proj", "gate_up", "down_proj"]


def roles(names: list[str]) -> list[str]:
    out = [n for n in names]
    attn = [i for i, n in enumerate(names) if ATTENTION in n]
    # a single-token step's layer is five kernels (qkv, attention and the three products after it), named;
    # other layers' kernels are named by their place after the layer's attention kernel, and their name
    named = len(attn) < 2 or attn[1] - attn[0] == len(AFTER) + 2
    after = len(AFTER) if named else attn[1] - attn[0] - 1
    for i in attn:
        if i > 0 and named:
            out[i - 1] = "qkv"
        out[i] = "attention"
        for j in range(1, after + 1):
            if i + j < len(names) and ATTENTION not in names[i + j]:
                out[i + j] = AFTER[j - 1] if named else f"attention +{j}: {names[i + j][:50]}"
    if attn:
        for i in range(attn[-1] + after + 1, len(names)):
            out[i] = "after layers: " + names[i][:50]
        for i in range(0, attn[0] - (1 if named else 0)):
            out[i] = "before layers: " + names[i][:50]
    return out


def graph_report(events: list) -> None:
    span = events[-1][1] + events[-1][2] - events[0][1]
    by = defaultdict(lambda: [0, 0.0, 0.0])
    latest = events[0][1]
    for role, (name, start, dur) in zip(roles([e[0] for e in events]), events):
        end = start + dur
        row = by[role]
        row[0] += 1
        row[1] += dur
        row[2] += max(0.0, end - latest)
        latest = max(latest, end)
    print(f"graph replay: {len(events)} kernels, span {span:.1f} us")
    print("| role | count | mean us | mean increment us | increments us |")
    print("|---|---|---|---|---|")
    for role, (n, dur, inc) in sorted(by.items(), key=lambda kv: -kv[1][2]):
        print(f"| {role} | {n} | {dur / n:.2f} | {inc / n:.2f} | {inc:.1f} |")


def steps_report(events: list, graph_first: str, graph_len: int, show: int = 4) -> None:
    # a replay starts at each event named like the graph's first kernel followed by a full replay
    starts = [i for i, e in enumerate(events) if e[0] == graph_first]
    starts = [i for i in starts if i + graph_len <= len(events)]
    shown = 0
    spans, outs = [], []
    for a, b in zip(starts, starts[1:]):
        end_graph = a + graph_len
        if b < end_graph:
            continue
        g_end = max(e[1] + e[2] for e in events[a:end_graph])
        nxt = events[b][1]
        spans.append(nxt - events[a][1])
        outs.append(nxt - g_end)
        if shown < show:
            print(f"between replays (graph end -> next replay start {nxt - g_end:.1f} us):")
            for name, start, dur in events[end_graph:b]:
                print(f"   +{start - g_end:7.1f} us  {dur:6.1f} us  {name}")
            shown += 1
    if spans:
        spans.sort()
        outs.sort()
        print(f"steps: {len(spans)}, replay start to next replay start median {spans[len(spans) // 2]:.1f} us, "
              f"outside the graph median {outs[len(outs) // 2]:.1f} us")


def main() -> None:
    data = json.load(open(sys.argv[1]))
    graph = data["graph"]
    graph_report(graph)
    steps_report(data["steps"], graph[0][0], len(graph))


if __name__ == "__main__":
    main()
