"""`tokenmill generate`: offline generation for prompts given or read from stdin."""
from __future__ import annotations

import sys

from tokenmill.cli.engine_args import engine_config


def _generate(args) -> int:
    from tokenmill import LLM
    from tokenmill.models.presets import check_text_prompts
    from tokenmill.sampling_params import SamplingParams

    check_text_prompts(args.model, args.tokenizer)       # before a preset's long build
    cfg = engine_config(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    llm = LLM(**{k: v for k, v in vars(cfg).items() if k != "extra"})
    prompts = args.prompt or [sys.stdin.read()]
    if args.chat:
        # token ids: the rendered text holds its BOS already, which encoding it as a prompt would add again
        tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    texts = [c.text for out in llm.generate(prompts, params) for c in out.outputs]
    for i, text in enumerate(texts):
        if i:
            print(GENERATE_SEPARATOR, flush=True)
        print(text, flush=True)
    return 0


# between the outputs of several prompts, so that multi-line outputs stay apart
GENERATE_SEPARATOR = "-" * 40
