"""Structured output and logit_bias on the GPU (CUDA graphs on): a tiny random Qwen3 model with the tests'
byte-level tokenizer; JSON schema outputs parse and match, plain rows beside constrained ones keep their
greedy tokens, +100 logit_bias forces a token. Prints one JSON line; exit status 1 on a failed check.

    python3 scripts/device/check_structured.py      (needs xgrammar, apache-tvm-ffi and pydantic:
                                                      carry their wheels as bench_structured.sh says)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from conftest import make_model, make_tokenizer  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["name", "n", "tags"]}


def main() -> int:
    path = tempfile.mkdtemp()
    make_tokenizer(path)
    make_model(path, "qwen3")
    llm = LLM(path, max_model_len=256, num_kv_blocks=2048)
    prompts = [f"prompt {i} " * (1 + i % 5) for i in range(24)]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    so = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    t = time.perf_counter()
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    t_plain = time.perf_counter() - t
    t = time.perf_counter()
    mixed = llm.generate(prompts + prompts[:8], [plain] * len(prompts) + [so] * 8)
    t_mixed = time.perf_counter() - t
    checks = {"plain_rows_unchanged": [o.outputs[0].token_ids for o in mixed[:len(prompts)]] == alone}
    texts = [o.outputs[0].text for o in mixed[len(prompts):]]
    ok = []
    for o in mixed[len(prompts):]:
        try:
            v = json.loads(o.outputs[0].text)
            ok.append(o.outputs[0].finish_reason == "stop" and set(v) == {"name", "n", "tags"}
                      and len(v["name"]) <= 6 and 0 <= v["n"] <= 99 and set(v["tags"]) <= {"a", "b"})
        except ValueError:
            ok.append(False)
    checks["json_valid"] = all(ok)
    forced = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                     logit_bias={333: 100.0}))[0].outputs[0].token_ids
    checks["logit_bias_forces"] = forced == [333] * 8
    sampled = llm.generate(prompts[:4], SamplingParams(temperature=0.8, seed=5, max_tokens=120, n=2,
                                                       structured_outputs=so.structured_outputs))
    checks["sampled_json_valid"] = all(c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)
                                       for o in sampled for c in o.outputs)
    print(json.dumps({"checks": checks, "texts": texts[:4], "seconds_plain": round(t_plain, 3),
                      "seconds_mixed": round(t_mixed, 3)}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
