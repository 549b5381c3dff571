"""An OpenAI-compatible HTTP server: completions and chat, continuous batching, speculative decoding in every row.

    python server.py --model demo/target --draft-model demo/draft --port 8080
    curl localhost:8080/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "target", "prompt": "def area(self): return self.<extra_id_0>", "max_tokens": 20}'

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
import logging
import math
import signal
import sys
import threading
import time
import warnings

import cpu  # noqa: F401  (before mlx.core)

import uvicorn
from fastapi import FastAPI

from errors import OptionError, T5Error
from loading import load
from options import KNOBS, Settings
from serving.app import create_app
from serving.engine import Engine

log = logging.getLogger("t5-server")


class Server(uvicorn.Server):
    """uvicorn in a thread of its own: the main thread owns MLX (MLX's
    compiled functions and streams belong to threads), and takes the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def serve(engine: Engine, app: FastAPI, host: str, port: int, grace: float) -> None:
    """Run the engine here and the HTTP server beside it. SIGTERM or SIGINT
    turns new requests away (503) while the requests taken finish, for up to
    `grace` seconds; a second signal stops at once."""
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="http", daemon=True)
    deadline = [math.inf]

    def stop(sig, frame):
        if engine.draining:
            deadline[0] = 0.0
            return
        engine.draining, deadline[0] = True, time.perf_counter() + grace
        log.info("stopping: finishing %d requests (up to %.0f s)", len(engine.jobs) + len(engine.waiting), grace)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    http.start()
    engine.run(lambda: engine.draining and (not engine.busy or time.perf_counter() > deadline[0]))
    server.should_exit = True
    http.join(timeout=10)


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
    p.add_argument("--name", help="the model name clients give (default: the target folder's name; 'default' is always accepted)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoding at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; beyond, 429")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt accepted")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    p.add_argument("--api-key", help="require this bearer token on /v1/ requests")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    library = Settings()
    for name, knob in KNOBS.items():  # the requests' defaults
        default = "" if "default" in knob.help else f" (default: {getattr(library, name)})"
        p.add_argument(f"--{knob.flag}", type=str if knob.words else knob.type,
                       help=f"{knob.help}, unless a request gives its own{default}")
    return p


def server_settings(args) -> Settings:
    """The requests' default settings, from the knob flags."""
    values = {}
    for name, knob in KNOBS.items():
        given = getattr(args, name)
        if given is not None:
            values[name] = knob.parse(given, f"--{knob.flag}") if isinstance(given, str) else knob.check(given, f"--{knob.flag}")
    return Settings(**values, speculative=True, prompt_lookup=args.prompt_lookup)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    try:
        for option in ("max_batch", "max_queue", "max_prompt_tokens", "max_body_bytes"):
            if getattr(args, option) < 1:
                raise OptionError(f"--{option.replace('_', '-')} must be at least 1")
        if args.prompt_lookup and args.draft_model:
            raise OptionError("--prompt-lookup drafts without a draft model: drop --draft-model (or --prompt-lookup)")
        defaults = server_settings(args)
        models = load(args.model, draft=args.draft_model, verbose=True)
        defaults.check_models(models)
    except T5Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or models.target_path.name
    engine = Engine(models, defaults, args.max_batch, args.max_queue)
    app = create_app(models, engine, name, args.api_key, args.max_prompt_tokens, args.max_body_bytes)
    log.info("serving %s on http://%s:%d (batches of %d, queue %d)", name, args.host, args.port, args.max_batch, args.max_queue)
    serve(engine, app, args.host, args.port, args.grace)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
