"""Baseline OpenAI-compatible servers on Hugging Face transformers, for `tokenmill bench serve` to compare with.

- `hf`: the common naive deployment. One `model.generate()` at a time (an asyncio lock), tokens streamed
  through a streamer as they are produced; other requests wait in line.
- `hf-cb`: transformers' continuous batching manager (`init_continuous_batching`, set up by
  `tokenmill.bench.hf_backends.HFContinuousBatching`), each request added with `streaming=True`; one
  thread routes the manager's outputs to the waiting HTTP handlers.

Both serve /v1/completions and /v1/chat/completions (streaming with `stream_options.include_usage`,
max_tokens, temperature 0 = greedy, ignore_eos), /v1/models (with a `hardware` field) and /health.
Text needs a tokenizer (`--tokenizer DIR` for random-weight presets, which ship none); without one, only
token-id completion prompts are accepted and the streamed text is empty.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import threading
import time
import uuid

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _QueueStreamer:
    """`generate(streamer=...)`: the first `put` is the prompt, later ones the new token(s) of each step."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue, self.seen_prompt = loop, queue, False

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

    def end(self):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class HFGenerateBackend:
    name = "hf"

    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, eos_ids: list[int]):
        from tokenmill.bench.hf_backends import load_hf_model
        self.model = load_hf_model(model_path, dtype, device, "sdpa")
        self.device, self.eos_ids = device, eos_ids
        self.lock = asyncio.Lock()

    def _generate(self, ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool, streamer):
        from transformers import GenerationConfig
        sample = temperature > 0
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=sample, temperature=temperature if sample else None,
                                  top_p=None, top_k=None, pad_token_id=0,
                                  eos_token_id=None if ignore_eos or not self.eos_ids else list(self.eos_ids))
        try:
            with torch.inference_mode():
                self.model.generate(input_ids=torch.tensor([ids], device=self.device),
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                                    generation_config=config, streamer=streamer)
        except Exception as e:
            streamer.loop.call_soon_threadsafe(streamer.queue.put_nowait, e)
            streamer.end()

    async def stream(self, ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool):
        """Yields lists of new token ids."""
        async with self.lock:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            work = loop.run_in_executor(None, self._generate, ids, max_tokens, temperature, ignore_eos,
                                        _QueueStreamer(loop, queue))
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                await work


class HFCBBackend:
    name = "hf-cb"

    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, eos_ids: list[int],
                 max_memory_percent: float = 0.5):
        import inspect

        from tokenmill.bench.hf_backends import HFContinuousBatching
        self.runner = HFContinuousBatching(model_path, dtype, device, max_memory_percent=max_memory_percent)
        self.manager = self.runner.manager
        self.eos_ids = eos_ids
        self._add_params = inspect.signature(self.manager.add_request).parameters
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._dispatch, name="hf-cb-dispatch", daemon=True).start()

    def _dispatch(self):
        while not self._stop.is_set():
            result = self.manager.get_result(timeout=0.1)
            if result is None:
                continue
            with self._lock:
                route = self._routes.get(result.request_id)
            if route is not None:
                route[0].call_soon_threadsafe(route[1].put_nowait, result)

    async def stream(self, ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = f"srv-{uuid.uuid4().hex}"
        with self._lock:
            self._routes[rid] = (loop, queue)
        kwargs = {"max_new_tokens": max_tokens}
        if "streaming" in self._add_params:
            kwargs["streaming"] = True
        if "eos_token_id" in self._add_params:
            kwargs["eos_token_id"] = -1 if ignore_eos or not self.eos_ids else list(self.eos_ids)
        sent = 0
        try:
            self.manager.add_request(input_ids=list(ids), request_id=rid, **kwargs)
            while True:
                result = await queue.get()
                if getattr(result, "error", None):
                    raise RuntimeError(f"hf-cb request failed: {result.error}")
                tokens = list(result.generated_tokens)[:max_tokens]
                if len(tokens) > sent:
                    yield tokens[sent:]
                    sent = len(tokens)
                if result.is_finished():
                    return
        finally:
            with self._lock:
                self._routes.pop(rid, None)
            if sent < max_tokens and hasattr(self.manager, "cancel_request"):
                self.manager.cancel_request(rid)

    def close(self):
        self._stop.set()
        self.runner.close()


class _TextStream:
    """Incremental detokenisation: emits new text, holding back a trailing partial UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def build_hf_app(backend, tokenizer, served_name: str, hardware: str, max_model_len: int):
    app = FastAPI(title=f"tokenmill {backend.name} baseline")
    created = int(time.time())

    def error(status: int, message: str):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                            status_code=status)

    def prompt_ids(body: dict, chat: bool) -> list[int] | str:
        if chat:
            if tokenizer is None:
                return "this server has no tokenizer (start it with --tokenizer DIR) so it cannot serve chat"
            msgs = [{"role": m.get("role", "user"), "content": m.get("content") if isinstance(m.get("content"), str)
                     else "".join(p.get("text", "") for p in m.get("content") or [])} for m in body["messages"]]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return list(p)
        if isinstance(p, str):
            if tokenizer is None:
                return "this server has no tokenizer (start it with --tokenizer DIR): send token-id prompts"
            return tokenizer.encode(p)
        return "'prompt' must be a string or a list of token ids (one prompt per request)"

    async def handle(raw: Request, chat: bool):
        try:
            body = await raw.json()
        except Exception:
            return error(400, "the body is not JSON")
        if body.get("model") not in (None, served_name):
            return error(404, f"The model `{body.get('model')}` does not exist.")
        ids = prompt_ids(body, chat)
        if isinstance(ids, str):
            return error(400, ids)
        if not ids or len(ids) >= max_model_len:
            return error(400, f"the prompt has {len(ids)} tokens; it must have 1 to {max_model_len - 1}")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or (256 if chat else 16))
        max_tokens = max(1, min(max_tokens, max_model_len - len(ids)))
        temperature = float(body.get("temperature") if body.get("temperature") is not None else 1.0)
        ignore_eos = bool(body.get("ignore_eos"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        text = _TextStream(tokenizer)

        def choice(delta: str, finish: str | None):
            if chat:
                return {"index": 0, "delta": {"content": delta} if delta else {}, "logprobs": None,
                        "finish_reason": finish}
            return {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": len(text.ids),
                    "total_tokens": len(ids) + len(text.ids)}

        def chunk(choices):
            return {"id": rid, "object": obj, "created": int(time.time()), "model": served_name, "choices": choices}

        gen = backend.stream(ids, max_tokens, temperature, ignore_eos)
        if not body.get("stream"):
            try:
                async for new in gen:
                    text.add(new)
            except Exception as e:
                return error(500, f"generation failed: {e}")
            out = text.add([], final=True)
            content = text.tokenizer.decode(text.ids, skip_special_tokens=True) if tokenizer is not None else out
            finish = "length" if len(text.ids) >= max_tokens else "stop"
            c = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                  "finish_reason": finish} if chat else
                 {"index": 0, "text": content, "logprobs": None, "finish_reason": finish})
            return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": served_name, "choices": [c], "usage": usage()})

        async def sse():
            if chat:
                yield f"data: {_dumps(chunk([{'index': 0, 'delta': {'role': 'assistant', 'content': ''}, 'logprobs': None, 'finish_reason': None}]))}\n\n"
            try:
                async for new in gen:
                    delta = text.add(new)
                    if delta:
                        yield f"data: {_dumps(chunk([choice(delta, None)]))}\n\n"
                finish = "length" if len(text.ids) >= max_tokens else "stop"
                yield f"data: {_dumps(chunk([choice(text.add([], final=True), finish)]))}\n\n"
                if include_usage:
                    yield f"data: {_dumps({**chunk([]), 'usage': usage()})}\n\n"
            except Exception as e:
                yield f"data: {_dumps({'error': {'message': str(e), 'type': 'server_error', 'code': 500}})}\n\n"
            finally:
                await gen.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await handle(raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await handle(raw, chat=True)

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [
            {"id": served_name, "object": "model", "created": created, "owned_by": backend.name,
             "max_model_len": max_model_len, "hardware": hardware}]})

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    return app


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def run_hf_server(args) -> int:
    """`tokenmill serve MODEL --backend hf|hf-cb`: load, then serve until interrupted."""
    import uvicorn

    from tokenmill.config import parse_dtype
    from tokenmill.engine.tokenizer import Tokenizer
    from tokenmill.models.presets import is_preset, preset_config, resolve_model_path
    from tokenmill.server.launch import bind

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    model_path = resolve_model_path(args.model, "bfloat16" if is_preset(args.model) else dtype_name, args.seed)
    with open(os.path.join(model_path, "config.json")) as f:
        hf_config = json.load(f)
    if is_preset(args.model):
        hf_config = {**preset_config(args.model), **hf_config}
    tok_dir = args.tokenizer or model_path
    tokenizer = Tokenizer(tok_dir).hf if Tokenizer.available(tok_dir) else None
    eos = hf_config.get("eos_token_id")
    eos_ids = sorted({*([eos] if isinstance(eos, int) else (eos or [])),
                      *([tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else [])})
    max_model_len = args.max_model_len or int(hf_config.get("max_position_embeddings") or 4096)
    sock = bind(args.host, args.port)
    dtype = parse_dtype(dtype_name)
    if args.backend == "hf":
        backend = HFGenerateBackend(model_path, dtype, device, eos_ids)
    else:
        backend = HFCBBackend(model_path, dtype, device, eos_ids)
    name = (args.served_model_name or [args.model])[0]
    app = build_hf_app(backend, tokenizer, name, _hardware(device), max_model_len)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_keep_alive=5))
    print(f"tokenmill: serving {name} with {backend.name} on http://{args.host}:{sock.getsockname()[1]} "
          f"(engine pid {os.getpid()})", flush=True)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        if hasattr(backend, "close"):
            backend.close()
        sock.close()
    return 0
