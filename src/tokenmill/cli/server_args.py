"""The API server's options of `serve`: HTTP (body and header limits, timeouts, CORS, TLS, docs) and chat
(template, tool-call and reasoning parsers, sampling defaults), and the settings built from them."""
from __future__ import annotations

import argparse
import json
import os

from tokenmill.cli.arg_types import cors_entry


def add_http_args(p: argparse.ArgumentParser):
    from tokenmill.server.launch import HTTPOptions
    d = HTTPOptions()
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="larger request bodies get 413 before they are read")
    p.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help="seconds an idle connection stays open after a response")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a client has to send a request's headers before its connection is closed")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a client has to send a request's body, from its headers, before its connection "
                        "is closed")
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="a request whose line and headers are longer gets 431")
    p.add_argument("--send-timeout", type=float, default=d.send_timeout,
                   help="seconds a client may leave its response unread (its buffers full) before its connection "
                        "is dropped and its request aborted")
    p.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help="open connections beyond this many get 503")
    p.add_argument("--allowed-origins", nargs="+", type=cors_entry, default=list(d.allowed_origins),
                   help="CORS origins, as words or as vLLM's JSON list ('[\"https://a.example\"]')")
    p.add_argument("--allowed-methods", nargs="+", type=cors_entry, default=list(d.allowed_methods),
                   help="CORS methods (words or a JSON list)")
    p.add_argument("--allowed-headers", nargs="+", type=cors_entry, default=list(d.allowed_headers),
                   help="CORS headers (words or a JSON list)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (with --ssl-keyfile)")
    p.add_argument("--ssl-ca-certs", default=None, help="the CA certificates that client certificates are checked "
                   "against")
    p.add_argument("--ssl-cert-reqs", type=int, default=d.ssl_cert_reqs,
                   help="client certificates: 0 not asked for, 1 checked if sent, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (vLLM's): the tokenizer's class and configuration, its chat "
                        "template included, which may be the deployment's own")
    p.add_argument("--root-path", default=d.root_path,
                   help="the path prefix under which a proxy in front serves this server (e.g. /llm): routes "
                        "answer with and without it, and the OpenAPI schema names it")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="add X-Request-Id to every response: the client's own, or a new one")


def _flat(entries) -> tuple[str, ...]:
    # CORS entries as words, JSON lists (`cors_entry`) or both
    return tuple(v for e in entries for v in (e if isinstance(e, list) else [e]))


def http_options(args):
    from tokenmill.server.launch import HTTPOptions
    return HTTPOptions(max_request_body_bytes=args.max_request_body_bytes, timeout_keep_alive=args.timeout_keep_alive,
                       header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                       send_timeout=args.send_timeout, max_header_bytes=args.max_header_bytes,
                       limit_concurrency=args.limit_concurrency,
                       allowed_origins=_flat(args.allowed_origins), allowed_methods=_flat(args.allowed_methods),
                       allowed_headers=_flat(args.allowed_headers), allow_credentials=args.allow_credentials,
                       ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                       ssl_cert_reqs=args.ssl_cert_reqs, docs=not args.disable_fastapi_docs,
                       tokenizer_info=args.enable_tokenizer_info_endpoint, root_path=args.root_path,
                       request_id_headers=args.enable_request_id_headers)


def add_chat_args(p: argparse.ArgumentParser):
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template replacing the model's: a file, or (as vLLM takes it) the "
                        "template itself")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the output: hermes (<tool_call> blocks: Qwen3, Nanbeige4.1, "
                        "Hermes), llama3_json (JSON objects, after <|python_tag|> or alone: Llama 3.1-3.3), "
                        "pythonic (a Python list of calls: Llama 3.2 / 4), granite (a JSON list after "
                        "<|tool_call|>: IBM Granite 3.x), phi4_mini_json (a JSON list after functools: "
                        "Phi-4-mini)")
    p.add_argument("--reasoning-parser", default=None,
                   help="put the model's thinking into reasoning (and reasoning_content): qwen3 (also "
                        "Nanbeige4.1), or deepseek_r1 (the reply always starts inside the thinking block)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens as 'token_id:{id}' for requests that do not say "
                        "(their return_tokens_as_token_ids)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them unset: 'auto' (the model's "
                        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty), 'vllm' "
                        "(none: temperature 1.0, no truncation), or a directory holding a generation_config.json")
    p.add_argument("--override-generation-config", default=None,
                   help='a JSON object of generation_config.json keys over those defaults, e.g. {"temperature": 0.5}')


def check_template(template: str) -> None:
    """ValueError where Jinja cannot compile the template as transformers compiles chat templates (a
    syntax error, an unknown filter): the operator's mistake, refused at start, not each chat request's 400."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:         # another transformers: its render still reports the error per request
        return
    try:
        _compile_jinja_template(template)
    except Exception as e:
        raise ValueError(f"--chat-template cannot be compiled: {str(e).splitlines()[0][:300]}") from None


def chat_options(args):
    from tokenmill.server.serving import ChatOptions
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        try:
            with open(template, encoding="utf-8") as f:
                template = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"--chat-template {template!r} is not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
    elif template is not None and not any(c in template for c in "{}\n"):
        # as vLLM reads --chat-template: a value that is no file but holds Jinja's braces or a line break
        # is the template itself
        raise ValueError(f"--chat-template {template!r}: no such file (nor a template: it has no '{{' and no "
                         "line break)")
    if template is not None:
        check_template(template)
    return ChatOptions(chat_template=template, enable_auto_tool_choice=args.enable_auto_tool_choice,
                       tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                       return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def generation_defaults(args) -> dict:
    from tokenmill.generation_config import sampling_defaults
    overrides = None
    if args.override_generation_config is not None:
        try:
            overrides = json.loads(args.override_generation_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--override-generation-config takes a JSON object, got "
                             f"{args.override_generation_config!r}")
    return sampling_defaults(args.generation_config, args.model, overrides)
