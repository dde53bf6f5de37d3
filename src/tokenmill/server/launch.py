"""Run the server: bind the socket, start the engine core, serve HTTP (server/http_server.py: uvicorn,
drain on SIGTERM, exit status).

With `api_server_count` > 1, server/api_servers.py runs several API server processes on the one socket
in front of one engine core, with the same signals and exit statuses; each serves through `serve`.
"""
from __future__ import annotations

import errno
import logging
import socket
import sys
from collections.abc import Sequence

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.core_client import EngineStartError
from tokenmill.server.guard import api_keys
from tokenmill.server.http_server import (HTTPOptions, ServeOptions, announce, configure_logging,
                                          import_app_modules, serve)


class PortInUse(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(e.errno, f"port {port} on {host} is already in use (is another server running "
                                     f"there?); stop it, or choose another port with --port") from None
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def raise_open_files_limit(connections: int | None) -> None:
    """Raises this process's soft limit on open files to its hard limit (as vLLM does): at the common soft
    limit of 1,024, connections past it were accepted and closed with nothing sent or logged, below
    --limit-concurrency's 503. Warns where even the hard limit is below that many connections."""
    try:
        import resource
    except ImportError:          # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if connections and soft != resource.RLIM_INFINITY and soft < connections + 64:
        logging.getLogger("tokenmill.server").warning(
            "open files are limited to %d (ulimit -n), under --limit-concurrency %d connections: connections "
            "past it are dropped without an answer; raise the limit or lower --limit-concurrency", soft, connections)


def run_server(config, *, host: str = "127.0.0.1", port: int = 8000, served_model_names=None,
               api_key: str | Sequence[str] | None = None, max_queue_len: int = 1024, engine_factory: str | None = None,
               log_level: str = "info", dead_grace_s: float = 2.0, in_process: bool = False,
               log_stats: bool = True, log_stats_interval: float = 10.0, log_requests: bool = False,
               http: HTTPOptions = HTTPOptions(), chat=None, api_server_count: int = 1,
               data_parallel_size: int = 1, sampling_defaults: dict | None = None, stream_interval: int = 1) -> int:
    """`api_key`: one key or several, any of which authorizes a request (None: an open server).
    `api_server_count` > 1: that many API server processes share the socket and one engine core
    (server/api_servers.py); 1 serves from this process. `data_parallel_size` > 1: this process serves
    in front of that many engine cores (engine/data_parallel.py). `sampling_defaults`: what requests that
    leave those fields unset sample with (generation_config.sampling_defaults). `stream_interval`: a streamed
    request's tokens a chunk (its first and last go at once)."""
    if api_server_count < 1:
        raise ValueError(f"api_server_count must be at least 1, got {api_server_count}")
    keys = api_keys(api_key)
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
    if api_server_count > 1 and in_process:
        raise ValueError("the engine loop cannot run in a thread of the server process with several API servers")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    if data_parallel_size > 1 and (api_server_count > 1 or in_process):
        raise ValueError(f"data_parallel_size={data_parallel_size} runs its engine cores in processes of their own "
                         "behind one API server process (not with several API servers, nor in process)")
    options = ServeOptions(tuple(served_model_names) if served_model_names else None, keys, max_queue_len,
                           log_level, dead_grace_s, log_stats, log_stats_interval, log_requests, http, chat,
                           sampling_defaults=tuple((sampling_defaults or {}).items()),
                           stream_interval=stream_interval)
    try:
        http.check_tls()
    except ValueError as e:
        print(f"tokenmill: {e}", file=sys.stderr, flush=True)
        return 1
    configure_logging(options)
    raise_open_files_limit(http.limit_concurrency)
    if sampling_defaults:
        from tokenmill.generation_config import describe
        logging.getLogger("tokenmill.server").info(
            "requests that leave them unset sample with the generation config's defaults: %s (--generation-config "
            "vllm keeps tokenmill's own)", describe(sampling_defaults))
    config.extra.setdefault("log_level", log_level)      # the engine core's process logs at this level too
    try:
        sock = bind(host, port)
    except OSError as e:
        print(f"tokenmill: {e.strerror}", file=sys.stderr, flush=True)
        return 1
    if api_server_count > 1:
        from tokenmill.server.api_servers import run_api_servers
        try:
            return run_api_servers(config, sock, host, options, api_server_count, engine_factory)
        finally:
            sock.close()
    try:
        if data_parallel_size > 1:
            from tokenmill.engine.data_parallel import DataParallelLLM
            engine = DataParallelLLM.start(config, data_parallel_size, engine_factory=engine_factory,
                                           while_starting=import_app_modules)
            print(f"tokenmill: {data_parallel_size} engine cores (pids {', '.join(map(str, engine.pids))})", flush=True)
        else:
            # the app's modules are imported while the core loads its model, not after
            engine = AsyncLLM(config, engine_factory=engine_factory, in_process=in_process,
                              while_starting=import_app_modules)
    except EngineStartError as e:
        sock.close()
        print(f"tokenmill: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        return serve(engine, sock, options,
                     on_serving=lambda: announce(engine.model_name, host, sock.getsockname()[1], engine.pid,
                                                  http.scheme))
    finally:
        engine.shutdown()
        sock.close()
