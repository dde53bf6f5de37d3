"""What the model-family tests (test_yarn, test_smollm3, test_granite, test_phi3, test_mistral) read of one
served sequence, transformers' reading of the same sequence, and their check of the CUDA engine against the CPU
engine's reading of it."""
from __future__ import annotations

import gc

import torch

from tokenmill import LLM


def sequence_logprobs(result, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """A RequestOutput's greedy tokens, and the logprob of each token after the first: the prompt's (its
    prompt_logprobs), then the output's."""
    out = result.outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(result.prompt_logprobs[1:], prompt[1:])]
    logprobs += [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
    return list(out.token_ids), torch.tensor(logprobs)


def transformers_logprobs(model_dir: str, prompt: list[int], tokens: list[int], **config) -> torch.Tensor:
    """transformers' logprob of each token of prompt + tokens after the first, in one float32 forward pass
    (`config`: from_pretrained's overrides), after checking that its greedy tokens past the prompt are `tokens`."""
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config).eval()(ids).logits[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == tokens
    return logits.log_softmax(-1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]


def assert_gpu_equals_cpu_engine(path: str, prompt: list[int], params, tokens: list[int], logprobs: torch.Tensor,
                                 max_num_seqs: int, **engine_args) -> None:
    """`prompt` served by the CUDA engine in float32, `max_num_seqs` copies at once: the CPU engine's greedy
    `tokens`, and its `logprobs` within float32 kernel rounding."""
    llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3,
              **engine_args)
    try:
        for result in llm.generate([prompt] * max_num_seqs, params):
            got_tokens, got = sequence_logprobs(result, prompt)
            assert got_tokens == tokens
            assert torch.allclose(got, logprobs, atol=2e-3), (got - logprobs).abs().max()
    finally:
        # its KV cache (0.3 of the GPU) freed now, not when a collection finds the engine's cycles: the next
        # engine's profile counts what is still allocated, and on an 80 GB GPU two do not fit in 0.3
        del llm
        gc.collect()
        torch.cuda.empty_cache()
