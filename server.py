"""An OpenAI-compatible HTTP server: completions and chat, continuous batching, speculative decoding in every row.

    python server.py --model demo/target --draft-model demo/draft --port 8080
    curl localhost:8080/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "demo/target", "prompt": "def area(self): return self.<extra_id_0>", "max_tokens": 20}'

One thread owns MLX (serving/engine.py): requests wait in a bounded queue,
and between rounds waiting requests join free rows and finished rows leave.
Each row keeps its own max_tokens, stop strings, sampling settings, seed,
delta and num_draft; rows of one drafting kind (the draft model, num-draft
auto, prompt lookup, or none) share a batch, and batches of different kinds
take rounds in turn. At temperature 0 and delta 0 each response is
`generate`'s on its prompt alone, whatever shares its batch. The HTTP side
is serving/app.py; docs/SERVING.md has the depth.
"""

import argparse
import contextlib
import gc
import ipaddress
import json
import logging
import math
import re
import signal
import socket
import sys
import threading
import time
import warnings

import cpu  # noqa: F401  (before mlx.core)
import speech

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from dataclasses import replace

from batches import batch_for, drive
from errors import OptionError, StageError, T5Error
from rows import Request
from loading import load
import pipeline
from options import KNOBS, Settings
from plans import resolve, with_presets
from text import plural
from serving.app import Limits, create_app
from serving.guard import Access, ip_literal
from serving.shapes import error_body
from serving.budget import ENCODING_MEASURED, RESERVED, Budget, encoding_memory, machine_memory, weights_bytes
from serving.engine import Engine

log = logging.getLogger("t5-server")
# Knobs a server sets for every request that gives none; not those that change an answer's shape (logprobs,
# choices) or its decoding's kind (beams), which each request asks for in its own fields.
SERVER_KNOBS = {name: knob for name, knob in KNOBS.items()
                if name not in ("logprobs", "n", "num_beams", "length_penalty", "early_stopping", "num_return_sequences")}
CACHE_BUDGET = 2 * 2**30  # bytes of cache one request may hold, unless --max-request-tokens says otherwise
# Seconds of the engine one request may hold, unless --max-request-tokens says otherwise: its tokens are at most
# what the loaded pair decodes in that time, a full batch at the server's default settings (request_tokens).
TIME_BUDGET = 60


class Server(uvicorn.Server):
    """uvicorn in a thread of its own: the main thread owns MLX (MLX's
    compiled functions and streams belong to threads), and takes the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def with_header_timeout(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request headers take
    longer than `seconds` to arrive (from its opening, or from the last
    answer): uvicorn has no such limit, and a client that sends a byte now
    and then would hold its connection for ever."""

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.header_deadline = self.loop.call_later(seconds, self.headers_late)

        def on_response_complete(self):
            self.header_deadline.cancel()
            self.header_deadline = self.loop.call_later(seconds, self.headers_late)
            super().on_response_complete()

        def connection_lost(self, exc):
            self.header_deadline.cancel()
            super().connection_lost(exc)

        def headers_late(self):
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening now: a port already taken
    fails here (OSError), before the models load, not in uvicorn's thread.
    Clients that come while the models load wait in the backlog."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections whose socket says so, and without it
    # each streamed chunk after the first waits for the client's delayed ACK (40 ms on Linux).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError:
        sock.close()
        raise
    return sock


def over_connections(most: int):
    """The ASGI app uvicorn answers with past its connection limit: a 503 in OpenAI's shape, the connection closed."""
    body = json.dumps(error_body(f"the server has {most} connections open, its most (--max-connections): try again "
                                 "shortly", "server_error")).encode()

    async def answer(scope, receive, send):
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return answer


def serve(engine: Engine, app: FastAPI, sock: socket.socket, grace: float, read_timeout: float,
          max_connections: int) -> int:
    """Run the engine here and the HTTP server beside it. SIGTERM or SIGINT
    turns new requests away (503) while the requests taken finish, for up to
    `grace` seconds; a second signal stops at once. If the HTTP server stops
    by itself, the engine stops too, and this returns 1."""
    # uvicorn counts the connection asking among those open: max_connections + 1 lets max_connections in.
    h11_impl.service_unavailable = over_connections(max_connections)  # its 503 is plain text: OpenAI's shape instead
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, http=with_header_timeout(read_timeout),
                            limit_concurrency=max_connections + 1)
    server = Server(config)
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    deadline = [math.inf]

    def stop(sig, frame):
        if engine.draining:
            deadline[0] = 0.0
            return
        engine.draining, deadline[0] = True, time.perf_counter() + grace
        log.info("stopping: finishing %s (up to %.0f s)", plural(engine.active + len(engine.waiting), "request"), grace)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    # What is loaded by now lives as long as the server. Frozen, it leaves the
    # collector: a full collection, which holds the GIL and so pauses the event
    # loop, scans what requests made (2 ms on the demo pair) instead of the
    # libraries and the tokenizer too (40 to 60 ms).
    gc.collect()
    gc.freeze()
    http.start()
    try:
        engine.run(lambda: not http.is_alive() or engine.draining and (not engine.busy or time.perf_counter() > deadline[0]))
    except StageError as e:  # a pipeline stage lost: nothing more can be decoded
        log.error("error: %s", e)
        server.should_exit = True
        return 1
    if not http.is_alive():
        log.error("the HTTP server stopped")
        return 1
    server.should_exit = True
    http.join(timeout=10)
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where there is one and the help does not already say it."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or action.required or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", required=True,
                   help="target model: converted folder, a name under mlx_models/, or a hub id it was converted from")
    p.add_argument("--draft-model",
                   help="draft model for speculative decoding (without it: prompt lookup if asked, else the target alone)")
    p.add_argument("--prompt-lookup", action="store_true", help="draft by prompt lookup unless a request says otherwise")
    p.add_argument("--stages", type=pipeline.stages_option, help="split the target over this many machines, run under mlx.launch "
                   "(rank 0 serves, the others compute), or stages of these encoder:decoder layers: docs/SERVING.md")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model names clients may give, the first in answers (default: --model as given; "
                        "'default' is always accepted)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--allowed-hosts", nargs="+", metavar="HOST",
                   help="Host headers answered besides the address listened on ('*': any; default: any on 0.0.0.0)")
    p.add_argument("--api-key", help="require this bearer token on every request but /health")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoding at once")
    p.add_argument("--max-queue", type=int, default=64, help="prompts waiting for a row; beyond, 429")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt accepted")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted")
    p.add_argument("--max-request-tokens", type=int,
                   help="most tokens one request may hold in its rows' caches, each prompt's tokens plus max_tokens "
                        f"(default: what {CACHE_BUDGET / 2**30:g} GiB of cache holds for these models, or what they decode "
                        f"in {TIME_BUDGET} s, whichever is less)")
    p.add_argument("--cache-memory", type=float, metavar="GB",
                   help="the caches' budget for all requests together, in GiB: a request is taken while what its rows "
                        "may hold fits, waits otherwise, and is refused if it never could (default: the machine's "
                        f"memory, a Mac's GPU working set, less the weights and {RESERVED:.0%}% of it)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    p.add_argument("--max-audio-mb", type=float, default=25.0, help="largest audio file accepted (OpenAI's limit)")
    p.add_argument("--max-audio-seconds", type=float, default=3600.0,
                   help="longest audio file accepted (its features, 3 MB a minute at 128 mel bins, are held while it "
                        "decodes)")
    p.add_argument("--read-timeout", type=float, default=30.0, help="seconds a request's headers, and then its body, may take")
    p.add_argument("--max-connections", type=int, default=256, help="open connections; beyond, 503")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--metrics-prefix", default="vllm:",
                   help="GET /metrics' names start with this (vLLM's, so that its dashboards read them; t5: before)")
    library = Settings()
    for name, knob in SERVER_KNOBS.items():  # the requests' defaults
        default = "" if "default" in knob.help else f" (default: {getattr(library, name)})"
        p.add_argument(f"--{knob.flag}", type=str if knob.words else knob.type,
                       help=f"{knob.help}, unless a request gives its own{default}")
    return p


def server_settings(args) -> Settings:
    """The requests' default settings, from the knob flags."""
    values = {}
    for name, knob in SERVER_KNOBS.items():
        given = getattr(args, name)
        if given is not None:
            values[name] = knob.parse(given, f"--{knob.flag}") if isinstance(given, str) else knob.check(given, f"--{knob.flag}")
    return Settings(**values, speculative=True, prompt_lookup=args.prompt_lookup)


def allowed_hosts(host: str, given: list[str] | None) -> frozenset | None:
    """The host names answered: the address listened on (with "localhost"
    on a loopback address) and those given; None (any) for "*", or on every
    interface unless hosts are given. Any IP address is answered too
    (serving.guard.Access): only names can be rebound."""
    if given and "*" in given:
        return None
    everywhere = host == "" or ip_literal(host) and ipaddress.ip_address(host).is_unspecified
    if everywhere and not given:
        return None
    names = {name.lower() for name in given or ()}
    if not everywhere:
        names.add(host.lower())
        if loopback(host):
            names |= {"localhost", "127.0.0.1", "::1"}
    return frozenset(names)


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def check_options(args) -> Settings:
    """The options a server cannot start with, as OptionErrors; the requests' default settings otherwise."""
    for option in ("max_batch", "max_queue", "max_prompt_tokens", "max_tokens_limit", "max_body_bytes", "max_connections"):
        if getattr(args, option) < 1:
            raise OptionError(f"--{option.replace('_', '-')} must be at least 1")
    if args.max_request_tokens is not None and args.max_request_tokens < 1:
        raise OptionError("--max-request-tokens must be at least 1")
    if args.read_timeout <= 0:
        raise OptionError("--read-timeout must be more than 0")
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", args.metrics_prefix):
        raise OptionError(f"--metrics-prefix {args.metrics_prefix!r} cannot start a Prometheus metric's name")
    if args.cache_memory is not None and args.cache_memory <= 0:
        raise OptionError("--cache-memory must be more than 0 GiB")
    if args.max_audio_mb <= 0 or args.max_audio_seconds <= 0:
        raise OptionError("--max-audio-mb and --max-audio-seconds must be more than 0")
    if args.api_key is not None and not args.api_key.strip():
        raise OptionError("--api-key is empty: give a key, or leave the option out")
    if args.prompt_lookup and args.draft_model:
        raise OptionError("--prompt-lookup drafts without a draft model: drop --draft-model (or --prompt-lookup)")
    defaults = server_settings(args)
    if defaults.max_tokens > args.max_tokens_limit:
        raise OptionError(f"--max-tokens {defaults.max_tokens} is over --max-tokens-limit {args.max_tokens_limit}")
    return defaults


def request_tokens(args, models, defaults: Settings) -> tuple[int, str]:
    """--max-request-tokens, or the less of what CACHE_BUDGET holds for the
    target's and the draft's caches and what the pair decodes in TIME_BUDGET
    seconds; and why, for the log."""
    if args.max_request_tokens is not None:
        return args.max_request_tokens, "--max-request-tokens"
    per_token = sum(model.cache_bytes_per_token for model in (models.target, models.draft) if model is not None)
    rate = decoding_rate(models, defaults, args.max_batch)
    held, timed = CACHE_BUDGET // per_token, int(TIME_BUDGET * rate)
    why = f"{TIME_BUDGET} s of decoding at {rate:,.0f} tokens/s" if timed < held else \
        f"what {CACHE_BUDGET / 2**30:g} GiB of cache holds"
    return min(held, timed), why


def cache_budget(args, models) -> tuple[Budget, str]:
    """--cache-memory, or what the machine's memory leaves past the weights and RESERVED; and why, for the log."""
    weights, memory = weights_bytes(models), machine_memory()
    limit = int(args.cache_memory * 2**30) if args.cache_memory is not None else int(memory * (1 - RESERVED)) - weights
    if limit <= 0:
        raise OptionError(f"the weights ({weights / 2**30:.1f} GiB) leave no room for caches in "
                          f"{memory / 2**30:.1f} GiB: give --cache-memory, or load a smaller (or quantized) model")
    why = "--cache-memory" if args.cache_memory is not None else \
        f"{memory / 2**30:.1f} GiB less {weights / 2**30:.2f} GiB of weights and {RESERVED:.0%}"
    encoding = encoding_memory(models, min(args.max_prompt_tokens, ENCODING_MEASURED))
    return Budget(models, limit, encoding), f"a {limit / 2**30:.2f} GiB cache budget ({why})"


def decoding_rate(models, defaults: Settings, rows: int) -> float:
    """Tokens a second the models decode, `rows` rows at once at the
    server's default settings: a short run timed after one that warms up."""
    settings = replace(defaults, max_tokens=16, min_tokens=0, ignore_eos=True, stop=(), logprobs=None)
    ids = models.tokenizer.encode("def rate(tokens, seconds): return tokens / seconds")
    for _ in range(2):  # the first compiles and warms
        requests = [Request(ids, settings) for _ in range(rows)]
        started = time.perf_counter()
        for _ in drive(batch_for(models, settings, rows), requests):
            pass
        seconds = time.perf_counter() - started
    return sum(request.stats.generated for request in requests) / seconds


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    try:
        defaults = check_options(args)
        if args.stages and pipeline.rank() > 0:  # a stage that only computes: load() works until rank 0 ends
            load(args.model, stages=args.stages)
        sock = listen(args.host, args.port)
    except T5Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port taken, the address not this machine's
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        models = load(args.model, draft=args.draft_model, verbose=True, stages=args.stages)
        # The model's generation defaults under the flags given; beams only where a request asks (use_beam_search).
        given = {name for name in SERVER_KNOBS if getattr(args, name) is not None}
        _, defaults, _ = with_presets(models, defaults, given, search=False)
        defaults = resolve(defaults, models).settings
        if defaults.max_tokens > args.max_tokens_limit:  # a model's max_length past the limit: the limit
            defaults = replace(defaults, max_tokens=args.max_tokens_limit)
    except T5Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.api_key is None and not loopback(args.host):
        log.warning("warning: %s is reachable beyond this machine and has no --api-key: anyone who reaches it can use it",
                    args.host)
    hosts = allowed_hosts(args.host, args.allowed_hosts)
    names = args.served_model_name or [args.model]
    audio_bytes = int(args.max_audio_mb * 2**20)
    if models.target.args.num_mel_bins:  # Whisper: a request is one file, a window of it at a time in a row
        warm, held = (lambda: speech.warm_up(models, defaults)), f"audio files up to {args.max_audio_mb:g} MB"
        limits = Limits(args.max_prompt_tokens, args.max_tokens_limit, None, audio_bytes, args.max_audio_seconds)
    else:
        budget, why = request_tokens(args, models, defaults)
        warm, held = None, f"requests up to {budget:,} cache tokens: {why}"
        limits = Limits(args.max_prompt_tokens, args.max_tokens_limit, budget, audio_bytes, args.max_audio_seconds)
    try:
        budget, budgeted = cache_budget(args, models)
    except T5Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = Engine(models, defaults, args.max_batch, args.max_queue, names[0], warm, args.metrics_prefix, budget)
    app = create_app(models, engine, names, Access(args.api_key, hosts), limits, args.max_body_bytes, args.read_timeout)
    log.info("serving %s on http://%s:%d (batches of %d, queue %d, %s; %s)", names[0], args.host, args.port,
             args.max_batch, args.max_queue, held, budgeted)
    code = serve(engine, app, sock, args.grace, args.read_timeout, args.max_connections)
    log.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
