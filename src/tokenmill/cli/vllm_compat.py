"""vLLM's `serve` flags that tokenmill honours, refuses or takes at one value, and vLLM's underscore
spellings of options; `serve.check_serve_args` acts on the flags."""
from __future__ import annotations

from tokenmill.cli.arg_types import int_value


# vLLM's serve flags that a launch line moved from vLLM may carry: those whose effect tokenmill always has
# (accepted, with a note at start), and those it does not have (a usage error saying why)
VLLM_HONOURED = {
    "--enable-chunked-prefill": "chunked prefill is always on (--max-num-batched-tokens is a step's budget)",
    "--disable-log-requests": "requests are logged only with --enable-log-requests",
    "--trust-remote-code": "tokenmill runs its own code for the architectures it supports, never a checkpoint's",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details (cached_tokens)",
    "--disable-uvicorn-access-log": "the server writes no access log",
    "--disable-custom-all-reduce": "tokenmill has no custom all-reduce kernel: tensor parallelism all-reduces "
                                   "through torch.distributed",
    "--max-log-len": "the request log (--enable-log-requests) shows no prompt text or token ids, only their count",
    "--max-seq-len-to-capture": "decode CUDA graphs hold every context length up to --max-model-len",
}
# the honoured flags that take a value (the others take none), each read by its type: a bad one is still a
# usage error naming it
VLLM_HONOURED_TYPES = {"--max-log-len": int_value, "--max-seq-len-to-capture": int_value}
VLLM_REFUSED = {
    "--download-dir": "tokenmill loads local directories and .gguf files only; it never downloads",
    "--revision": "tokenmill loads local directories and .gguf files only; it never downloads",
    "--max-logprobs": "the logprobs limit is OpenAI's, 20",
    "--limit-mm-per-prompt": "tokenmill serves text-only models",
    "--no-enable-chunked-prefill": "chunked prefill is always on; --max-num-batched-tokens bounds a step's tokens",
    "--enable-lora": "tokenmill serves no LoRA adapters",
    "--lora-modules": "tokenmill serves no LoRA adapters",
    "--middleware": "the server loads no code named on its command line",
    "--enable-log-outputs": "the request log (--enable-log-requests) holds no output text: token counts, finish "
                            "reasons and times",
    "--speculative-config": "tokenmill has no speculative decoding",
    "--compilation-config": "tokenmill compiles nothing with torch.compile: its Triton kernels and CUDA graphs are "
                            "fixed (--enforce-eager turns the graphs off, --cuda-graph-max-tokens bounds the "
                            "prefill steps they hold)",
}
# the refused flags that take no value, or several (the others take one, as vLLM's do)
VLLM_REFUSED_NARGS = {"--no-enable-chunked-prefill": 0, "--enable-lora": 0, "--lora-modules": "+",
                      "--enable-log-outputs": 0}
# vLLM's flags whose value tokenmill has only one way (or two equal ways) of: those values are accepted with a
# note at start, another is a usage error saying why
VLLM_FIXED = {
    "--response-role": (("assistant",), "a chat reply's role is always assistant"),
    "--chat-template-content-format": (("auto", "string"), "a message's content reaches the chat template as a "
                                       "string (its text parts joined), never as OpenAI's list of parts"),
    "--pipeline-parallel-size": (("1",), "tokenmill has no pipeline parallelism (--tensor-parallel-size splits "
                                 "each layer)"),
    "--tokenizer-mode": (("auto", "hf"), "the tokenizer loads as transformers' AutoTokenizer (the fast one where "
                         "the checkpoint has one), as vLLM's auto and hf; no slow, mistral_common or custom one"),
    "--load-format": (("auto", "safetensors", "gguf"), "tokenmill reads a model directory's safetensors or a .gguf "
                      "file, as the model names"),
    "--cpu-offload-gb": (("0",), "every weight stays in the device's memory; tokenmill offloads none to the CPU"),
}
# vLLM's short names of these flags
VLLM_SHORT = {"--pipeline-parallel-size": "-pp", "--compilation-config": "-O"}


def _vllm_dest(flag: str) -> str:
    return "vllm_" + flag.removeprefix("--").replace("-", "_")


def vllm_spellings(argv: list[str]) -> list[str]:
    """vLLM's parser also takes options spelled with underscores (--max_model_len): here as dashes."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out
