"""python -m dflash.serve: an OpenAI-compatible HTTP server (chat and text completions, streaming) with continuous
batching on PyTorch: a request joins the running batch at the next cycle and leaves when it finishes."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from . import backends, cli
from .core.extras import blas
from .core.errors import DFlashError

BUNDLED_NAME = "dflash-bundled"


def parse_args(argv=None):
    p = cli.Parser(prog="python -m dflash.serve", description=__doc__)
    cli.add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 .. 65535; 0 = any free port (default: %(default)s)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: none)")
    p.add_argument("--served-model-name", help="the model id clients send (default: --model, or dflash-bundled)")
    p.add_argument("--max-batch", type=int, default=16, help="rows decoded together, on both backends (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a row before 503 (default: %(default)s)")
    p.add_argument("--prefill-step", type=int, default=256,
                   help="prompt tokens a joining request prefills between two cycles of the running ones (chunked "
                   "prefill; default: %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="(default: %(default)s)")
    p.add_argument("--prefix-cache-mb", type=float, default=1024,
                   help="finished sequences' caches kept for prompts sharing their prefix (default: %(default)s; "
                   "0 = off: only the last sequence, when it runs alone)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests (meanwhile /health and new requests get 503); "
                   "those still running then end with an error event (default: %(default)s)")
    p.add_argument("--chat-template", help="a Jinja chat template file replacing the model's (requests cannot "
                   "supply one)")
    p.add_argument("--default-sampling", default="model", choices=("model", "openai"),
                   help="sampling fields a request leaves out: model = the target's generation_config.json "
                   "(temperature, top_p, top_k, min_p, repetition_penalty; vLLM's behaviour), then OpenAI's; openai = "
                   "OpenAI's (temperature 1) (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds to receive a request's whole body before 408 (default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=30.0,
                   help="seconds a connection has to send a request's headers, from connecting or from the end of "
                   "its previous response (default: %(default)s)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the --api-key (default: /metrics needs it when one is set)")
    p.add_argument("--log-level", default="info", help="(default: %(default)s)")
    return p.parse_args(argv)


def check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise DFlashError(f"--port: got {args.port}, expected 0 .. 65535")
    for flag, value, low in (("--max-batch", args.max_batch, 1),
                             ("--max-queue", args.max_queue, 0), ("--max-request-bytes", args.max_request_bytes, 1),
                             ("--prefill-step", args.prefill_step, 1)):
        if value < low:
            raise DFlashError(f"{flag}: got {value}, expected >= {low}")
    if args.compile:
        raise DFlashError("--compile: the server decodes its requests as one batch on the dynamic cache; the static, "
                          "compiled cache runs one stream (generate, chat, bench)")
    if args.prefix_cache_mb < 0:
        raise DFlashError(f"--prefix-cache-mb: got {args.prefix_cache_mb}, expected >= 0")
    if not args.drain_timeout >= 0:
        raise DFlashError(f"--drain-timeout: got {args.drain_timeout}, expected >= 0")
    for flag, value in (("--body-timeout", args.body_timeout), ("--header-timeout", args.header_timeout)):
        if not value > 0:
            raise DFlashError(f"{flag}: got {value}, expected > 0 seconds")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise DFlashError(f"--chat-template: {args.chat_template} is not a file (expected a Jinja template file)")


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    try:
        from .server.app import Server
        from .server.intake import model_sampling_defaults
        from .server.runner import bind, run, url
        from .server.scheduler import engine_executor
    except ImportError as e:
        raise DFlashError(f"dflash.serve: {e.name} is not installed; pip install -e \".[serve]\"") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    if backends.pick(args.backend) == "mlx":
        blas.restart_mlx_run_with_openblas()  # (re-executes the process: on the main thread, before any work)
    sock = bind(args.host, args.port)  # before the model loads: a port in use is refused at once
    # the model is loaded on the thread that will decode with it: MLX arrays built lazily on one thread cannot be
    # evaluated on another ("There is no Stream(cpu, 0) in current thread")
    executor = engine_executor()
    pipe = executor.submit(cli.load_pipeline, args).result()
    defaults = model_sampling_defaults(pipe.target_dir) if args.default_sampling == "model" else {}
    name = args.served_model_name or (args.model if args.model else BUNDLED_NAME)
    aliases = {str(args.model), Path(str(args.model)).name} if args.model else set()
    server = Server(pipe, model_name=name, aliases=aliases, max_batch=args.max_batch, max_queue=args.max_queue,
                    api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                    drain_timeout=args.drain_timeout, prefix_cache_mb=args.prefix_cache_mb, chat_template=template,
                    sampling_defaults=defaults, body_timeout=args.body_timeout, metrics_public=args.metrics_public,
                    executor=executor, prefill_step=args.prefill_step)
    logging.getLogger("dflash.serve").info("serving %s on %s (backend %s, max batch %d, default sampling %s)", name,
                                           url(sock), pipe.backend_name, server.scheduler.max_batch,
                                           defaults or "OpenAI's")
    run(server, sock, args.log_level, header_timeout=args.header_timeout)
    return 0


if __name__ == "__main__":
    code = cli.run(main)
    # Served and drained: the engine thread has ended (or is stuck in a kernel past the drain). Skip the
    # interpreter's teardown: with torch loaded it takes seconds beyond --drain-timeout, and it destroys native
    # thread pools under a thread that may still run ("terminate called without an active exception", SIGABRT).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
