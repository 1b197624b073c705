"""`laneserve serve`: the OpenAI-compatible HTTP daemon.

It binds first (so `/health` and `/ready` answer 503 while the model loads), loads the
checkpoint on a worker thread, starts the engine thread (whose warm-up runs there), and
logs `serving on http://HOST:PORT` once requests can be answered. SIGTERM or SIGINT
drains: `/ready` and new requests turn 503, running streams finish until
--drain-timeout, the rest end with an error event and `[DONE]`, and it exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Callable

import prometheus_client
from families.lfm2 import open_target
from families.lfm2.config import generation_defaults
from lanes.client import EngineClient
from lanes.engine import Engine, EngineConfig
from lanes.prefix_cache import default_budget_bytes

from .app import Server, ServerConfig, Serving, make_serving
from .wired import MIB, wire_for_serving

log = logging.getLogger("laneserve")

EMBEDDED_NAME = "laneserve-default"


def add_serve(sub) -> None:
    from .cli import add_drafting  # cli imports this module to register the subcommand

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (streaming, metrics, drain)")
    p.add_argument("--model", help="target checkpoint directory (HF LFM2 / LFM2-MoE format); default: the embedded "
                   "small LFM2 and its DSpark drafter")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one; the log says which)")
    p.add_argument("--max-streams", type=int, default=16, help="lanes decoding together (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a lane before 429 (default 64)")
    p.add_argument("--max-model-len", type=int, help="context limit in tokens, prompt + max_tokens "
                   "(default: the model's own)")
    p.add_argument("--served-model-name", help="the model id clients send and see (default: the checkpoint "
                   f"directory's name; {EMBEDDED_NAME} for the embedded model)")
    p.add_argument("--api-key-env", metavar="VAR", help="require `Authorization: Bearer KEY` where KEY is this "
                   "environment variable's value (/health, /ready and /metrics stay open)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running streams may finish after "
                   "SIGTERM/SIGINT (default 30)")
    p.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                   help=f"largest request body accepted (default {ServerConfig.max_body_bytes}); larger gets 413")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="cast weights (default: as stored; float32 when MLX runs on the CPU)")
    p.add_argument("--prefix-cache-bytes", metavar="SIZE",
                   help="memory kept for the caches of prompts already read, so a conversation's next turn reads "
                   "only its new tokens: bytes, or with K, M, G or T (4G); 0 turns the cache off (default: a "
                   "quarter of the memory left once the model is loaded)")
    add_drafting(p)
    p.set_defaults(run=run_serve)


def server_config(args) -> ServerConfig:
    """Flags -> the HTTP side's settings (`resolve_models` has run)."""
    from .cli import UsageError

    for flag in ("max_streams", "max_queue", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.drain_timeout < 0:
        raise UsageError("--drain-timeout must be >= 0")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise UsageError(f"--api-key-env {args.api_key_env}: that environment variable is unset or empty")
    name = args.served_model_name or (EMBEDDED_NAME if args.embedded else os.path.basename(os.path.normpath(args.model)))
    if not name or "/" in name or name in (".", ".."):
        raise UsageError(f"--served-model-name must be a plain name, got {name!r}")
    return ServerConfig(name, api_key, args.max_body_bytes)


def open_serving(args, config: ServerConfig, build_engine=Engine) -> tuple[Serving, Callable[[], None]]:
    """Load the checkpoint and drafter, wire their memory (Metal), start the engine thread
    (its warm-up runs there); returns what serves and what puts the wired limit back.
    `build_engine` takes Engine's arguments (bench/serve_scripted.py passes its own)."""
    from .cli import UsageError, open_drafter

    loaded = open_target(args.model, dtype=args.dtype, max_lanes=args.max_streams)
    cfg, target = loaded.target.config, loaded.target
    log.info("model %s (%s, %d layers, vocab %d, %s) served as %r", args.model, cfg.model_type, cfg.num_layers,
             target.vocab_size, str(target.dtype).removeprefix("mlx.core."), config.model_name)
    limit = target.context_limit
    if args.max_model_len is not None and not 1 <= args.max_model_len <= limit:
        raise UsageError(f"--max-model-len must be within 1..{limit} (the model's context limit), got {args.max_model_len}")
    max_model_len = args.max_model_len or limit
    drafter = None if args.no_draft else open_drafter(args, loaded)
    if drafter is None:
        log.info("drafter: none, every round plain")
    elif args.prompt_lookup:
        log.info("prompt lookup: drafts may be copied from earlier matches of %d+ tokens in a lane's own text", args.prompt_lookup)
    restore_wired = wire_for_serving(target, drafter, max_model_len, log)  # Metal only; a no-op elsewhere
    # The default is measured here, with the weights already in memory.
    cache_bytes = default_budget_bytes() if args.prefix_cache_bytes is None else args.prefix_cache_bytes
    engine_config = EngineConfig(max_streams=args.max_streams, max_waiting=args.max_queue, draft_width=args.draft_width,
                                 prompt_lookup=args.prompt_lookup, prefix_cache_bytes=cache_bytes,
                                 overlap=False if args.no_overlap else None)
    engine = build_engine(target, loaded.tokenizer, loaded.eos_ids, drafter, engine_config)
    log.info("lanes: up to %d per round, %d waiting at most", args.max_streams, args.max_queue)
    if drafter is not None:
        log.info("drafted rounds: %s", "overlapped, each read while the next runs" if engine.rounds.overlap else
                 "one at a time, each read before the next is built" + (" (--no-overlap)" if args.no_overlap else ""))
    log.info("context: %d tokens per request (prompt + max_tokens)", max_model_len)
    if cache_bytes:
        log.info("prefix cache: %.1f MB for prompt prefixes, in blocks of %d tokens%s", cache_bytes / MIB,
                 engine_config.prefix_block_tokens,
                 " (a quarter of the memory left)" if args.prefix_cache_bytes is None else "")
    else:
        log.info("prefix cache: off, every prompt read whole")
    defaults = generation_defaults(args.model)
    log.info("sampling defaults from generation_config.json: %s", defaults or "none (greedy)")
    client = EngineClient(engine)
    client.start(warm_up=drafter is not None and args.draft_width is None)
    return make_serving(client, loaded.tokenizer, target.vocab_size, config.model_name, max_model_len, defaults), restore_wired


def run_serve(args, build_engine=Engine) -> int:
    from .cli import byte_size, resolve_models

    args.embedded = args.model is None
    resolve_models(args)
    config = server_config(args)
    if args.prefix_cache_bytes is not None:
        args.prefix_cache_bytes = byte_size(args.prefix_cache_bytes, "--prefix-cache-bytes")
    prometheus_client.disable_created_metrics()  # as vLLM: no `_created` series beside every counter
    try:
        import uvloop
    except ImportError:  # no uvloop on Windows
        return asyncio.run(serve(args, config, build_engine))
    return uvloop.run(serve(args, config, build_engine))


async def serve(args, config: ServerConfig, build_engine=Engine) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = Server(config)
    host, port = await server.listen(args.host, args.port)
    address = f"http://{host}:{port}"
    log.info("listening on %s (/ready answers 503 until the model is loaded)", address)
    try:
        serving, restore_wired = await loop.run_in_executor(None, open_serving, args, config, build_engine)
    except BaseException:
        await server.close()
        raise
    server.attach(serving)
    while not stop.is_set() and not serving.client.ready:
        if not serving.client.health().alive:
            from .cli import INTERNAL_ERROR, LESS_MEMORY, USER_ERROR, ran_out_of_memory

            error = serving.client.health().error
            out_of_memory = ran_out_of_memory(error)
            if out_of_memory:
                log.error("the engine ran out of memory while warming up (%s); %s", error, LESS_MEMORY)
            else:
                log.error("the engine thread stopped while warming up: %s", error)
            await server.close()
            return USER_ERROR if out_of_memory else INTERNAL_ERROR
        await asyncio.sleep(0.05)
    if not stop.is_set():
        log.info("serving on %s", address)
        await stop.wait()
    log.info("draining: new requests get 503; running streams have %.1f s to finish", args.drain_timeout)
    await server.drain(args.drain_timeout)
    restore_wired()
    log.info("stopped")
    return 0
