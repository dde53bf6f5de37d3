"""Diffs two dump.py outputs kernel by kernel: PTX without line info (-v prints the first differences), SASS
instruction for instruction."""
import json, sys, difflib, re
def norm(p):
    out = []
    for l in p.splitlines():
        t = l.strip()
        if t.startswith((".loc", ".file")) or (t.startswith("$L__") and t.endswith(":")):
            continue
        l = re.sub(r"//.*$", "", l).rstrip()
        if l:
            out.append(l)
    t = "\n".join(out)
    i = t.find(".section\t.debug")
    return t if i < 0 else t[:i]
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for k in a:
    if k not in b:
        print(k, "MISSING"); continue
    ps = norm(a[k]["ptx"]).replace("context_lens_ptr", "seq_lens_ptr") == norm(b[k]["ptx"]).replace("context_lens_ptr", "seq_lens_ptr"); ss = a[k]["sass"] == b[k]["sass"]
    print(f"{k:24s} ptx {'same' if ps else 'DIFF'}  sass {'same' if ss else 'DIFF'} ({a[k]['n_sass']} / {b[k]['n_sass']} instr)")
    if not ps and "-v" in sys.argv:
        print("\n".join(list(difflib.unified_diff(a[k]["ptx"].splitlines(), b[k]["ptx"].splitlines(), lineterm="", n=1))[:40]))
