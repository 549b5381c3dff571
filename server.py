"""An OpenAI-compatible HTTP server: completions and chat, continuous batching, speculative decoding in every row.

    python server.py --model demo/target --draft-model demo/draft --port 8080
    curl localhost:8080/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "target", "prompt": "def area(self): return self.<extra_id_0>", "max_tokens": 20}'

One thread owns MLX (`Engine`): requests wait in a bounded queue, and between
rounds waiting requests join free rows and finished rows leave. Each row
keeps its own max_tokens, stop strings, sampling settings, seed, delta and
num_draft; rows of one drafting kind (the draft model, num-draft auto, prompt
lookup, or none) share a batch, and batches of different kinds take rounds in
turn. At temperature 0 and delta 0 each response is `generate`'s on its
prompt alone, whatever shares its batch. docs/SERVING.md has the depth.
"""

import argparse
import asyncio
import collections
import contextlib
import hmac
import json
import logging
import math
import signal
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import cpu  # noqa: F401  (before mlx.core)

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from decoder import AUTO, KNOBS, OptionError, Settings, Stats
from generate import Detokenizer, batch_for, warm_up
from loading import Models, ModelNotFound, T5Error, load

log = logging.getLogger("t5-server")

# ---------------------------------------------------------------- the engine


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One prompt of one HTTP request: what the engine decodes for it, and
    the pieces of text it sends back to the request's event loop."""

    ids: list[int]
    settings: Settings
    ignore_eos: bool
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    detokenizer: Detokenizer
    stats: Stats = field(default_factory=Stats)
    text: str = ""  # decided text not yet sent: it may be the start of a stop string
    finish_reason: str | None = None
    cancelled: bool = False  # the client left, or a stop string ended it
    sent_end: bool = False
    error: str | None = None

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def add(self, token: int | None, finished: bool) -> None:
        """A token decided for this prompt (in the engine's thread). A stop
        string ends the text before it; the tokens after it in the round are
        not output."""
        if self.finish_reason is not None:
            return
        if token is not None:
            self.text += self.detokenizer.add(token)
        if finished:
            self.text += self.detokenizer.flush()
        for stop in self.stop:
            if stop in self.text:
                self.text = self.text[: self.text.index(stop)]
                self.finish_reason, self.cancelled = "stop", True
        if finished and self.finish_reason is None:
            self.finish_reason = "length" if self.stats.generated >= self.settings.max_tokens else "stop"

    def publish(self) -> None:
        """After a round: send the text that can no longer turn out to be part
        of a stop string (one piece a round, however many tokens it took), and
        the end once it has come."""
        if self.sent_end:
            return
        finished = self.finish_reason is not None
        held = 0 if finished else max((n for stop in self.stop for n in range(len(stop), 0, -1)
                                       if self.text.endswith(stop[:n])), default=0)
        ready, self.text = self.text[: len(self.text) - held], self.text[len(self.text) - held:]
        if ready or finished:
            self.send((ready, self.finish_reason))
        if finished:
            self.send(None)
            self.sent_end = True

    def fail(self, message: str) -> None:
        self.error, self.finish_reason, self.sent_end = message, "error", True
        self.send(None)


class Engine:
    """What the thread that owns MLX (the main thread) runs. Jobs wait in a
    bounded queue; between rounds they join free rows (encoded together, by
    drafting kind), and finished or cancelled rows leave. An exception in a
    round fails that batch's jobs only. `draining` turns new jobs away while
    the ones taken finish."""

    def __init__(self, models: Models, defaults: Settings, max_batch: int, max_queue: int):
        self.models, self.defaults, self.max_batch, self.max_queue = models, defaults, max_batch, max_queue
        self.ready = False  # warmed up
        self.waiting: list[Job] = []
        self.lock = threading.Condition()
        self.batches: dict[tuple, object] = {}  # drafting kind -> its batch
        self.jobs: dict[int, Job] = {}  # id(request) -> job, for the rows decoding
        self.draining = False
        self.tokens = 0  # generated, for /metrics
        self.cancelled = 0  # rows dropped before their end (a client gone, a stop string)
        self.seconds = collections.Counter()  # where the engine's time went: encoding, decoding, idle
        self.recent = collections.deque()  # (time, tokens) of the last minute's rounds

    def submit(self, jobs: list[Job]) -> None:
        with self.lock:
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull()
            self.waiting += jobs
            self.lock.notify()

    @property
    def active(self) -> int:
        return sum(len(batch.rows) for batch in self.batches.values())

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in self.recent if now - t <= window]
        return sum(n for _, n in recent) / window

    def kind(self, settings: Settings) -> tuple:
        return settings.drafts(self.models), settings.prompt_lookup, settings.num_draft == AUTO

    def admit(self) -> None:
        """Waiting jobs join rows while there are rows free; cancelled ones leave."""
        with self.lock:
            if not self.waiting and not self.active:
                started = time.perf_counter()
                self.lock.wait(timeout=0.1)  # wakes for a job, and for the signals the main thread handles
                self.seconds["idle"] += time.perf_counter() - started
            taken = []
            while self.waiting and self.active + len(taken) < self.max_batch:
                job = self.waiting.pop(0)
                if not job.cancelled:
                    taken.append(job)
        by_kind = {}
        for job in taken:
            by_kind.setdefault(self.kind(job.settings), []).append(job)
        for kind, jobs in by_kind.items():
            batch = self.batches.get(kind)
            if batch is None:
                batch = self.batches[kind] = batch_for(self.models, jobs[0].settings, self.max_batch)
            requests = [replace(job.settings.request(job.ids, job.stats), ignore_eos=job.ignore_eos) for job in jobs]
            started = time.perf_counter()
            try:
                batch.join(requests)
            except Exception as e:  # encoding failed: these jobs only
                log.exception("encoding failed")
                for job in jobs:
                    job.fail(f"encoding failed: {e}")
                continue
            finally:
                self.seconds["encoding"] += time.perf_counter() - started
            self.jobs.update({id(request): job for request, job in zip(requests, jobs)})

    def run(self, stopping: Callable[[], bool]) -> None:
        """Serve until stopping() says so, between rounds; what is left then fails."""
        warm_up(self.models, "warm up", self.defaults)  # compiled kernels and traces, before the first request
        self.ready = True
        while not stopping():
            self.step()
        with self.lock:
            left, self.waiting = list(self.jobs.values()) + self.waiting, []
        for job in left:
            job.fail("the server stopped before this request finished")

    def step(self) -> None:
        """Admit waiting jobs, then a round of each batch."""
        self.admit()
        for kind, batch in list(self.batches.items()):
            gone = {row.request for row in batch.rows if self.jobs[id(row.request)].cancelled}
            if gone:
                batch.cancel(gone)
                self.cancelled += len(gone)
                for request in gone:
                    job = self.jobs.pop(id(request))
                    if not job.sent_end:  # whoever still waits on it stops waiting
                        job.sent_end = True
                        job.send(None)
            if not batch.rows:
                continue
            tokens, touched, started = 0, {}, time.perf_counter()
            try:
                for request, token, finished in batch.round():
                    job = touched[id(request)] = self.jobs[id(request)]
                    job.add(token, finished)
                    tokens += token is not None
                    if finished:
                        self.jobs.pop(id(request))
            except Exception as e:  # fail this batch's jobs, and start it afresh
                log.exception("a decoding round failed")
                for row in batch.rows:
                    job = self.jobs.pop(id(row.request), None)
                    if job is not None:
                        job.fail(f"decoding failed: {e}")
                del self.batches[kind]
            for job in touched.values():
                if job.error is None:
                    job.publish()
            self.seconds["decoding"] += time.perf_counter() - started
            self.tokens += tokens
            now = time.perf_counter()
            self.recent.append((now, tokens))
            while now - self.recent[0][0] > 60:
                self.recent.popleft()


# ---------------------------------------------------------------- requests


def knob_value(name: str, value, label: str | None = None):
    if value is None:
        return None
    return KNOBS[name].check(value, label or name)


class CompletionBody(BaseModel):
    """The fields of OpenAI's completion request this server reads; `top_k`,
    `num_draft`, `delta` and `prompt_lookup` are its own. Others are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    num_draft: int | str | None = None
    delta: float | None = None
    prompt_lookup: bool | None = None
    ignore_eos: bool = False  # vLLM's: decode on to max_tokens (benchmarks)

    @field_validator("max_tokens", "top_k", "top_p", "seed", "delta")
    @classmethod
    def in_range(cls, value, info):
        return knob_value(info.field_name, value)

    @field_validator("temperature")
    @classmethod
    def temperature_in_range(cls, value):
        return knob_value("temp", value, "temperature")

    @field_validator("num_draft")
    @classmethod
    def num_draft_in_range(cls, value):
        if isinstance(value, str):
            return KNOBS["num_draft"].parse(value, "num_draft")
        return knob_value("num_draft", value)

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def one_choice(cls, value):
        if value != 1:
            raise ValueError("n must be 1: ask again for more samples (with another seed)")
        return value

    def settings(self, defaults: Settings) -> Settings:
        given = {"max_tokens": self.max_tokens, "temp": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "seed": self.seed, "num_draft": self.num_draft, "delta": self.delta, "prompt_lookup": self.prompt_lookup}
        return replace(defaults, **{name: value for name, value in given.items() if value is not None})


class Completion(CompletionBody):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def non_empty(cls, value):
        prompts = [value] if isinstance(value, str) else value
        if not prompts or not all(p.strip() for p in prompts):
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo")
    @classmethod
    def no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value


class Message(BaseModel):
    role: str
    content: str

    @field_validator("role")
    @classmethod
    def known_role(cls, value):
        if value not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"unknown role {value!r} (system, user or assistant)")
        return value


class ChatCompletion(CompletionBody):
    messages: list[Message]

    @model_validator(mode="after")
    def a_user_speaks(self):
        if not any(m.role == "user" and m.content.strip() for m in self.messages):
            raise ValueError("messages need a user message with some text")
        return self


def chat_prompt(messages: list[Message]) -> str:
    """The one T5 prompt a conversation maps to: a single user message (after
    any system message) as it is, the system message first; longer
    conversations as "User: ..." and "Assistant: ..." lines, the system
    message first and "Assistant:" last, for the model to go on."""
    system = [m.content.strip() for m in messages if m.role in ("system", "developer")]
    turns = [m for m in messages if m.role in ("user", "assistant")]
    if len(turns) == 1:
        return "\n\n".join(system + [turns[0].content.strip()])
    lines = [f"{m.role.capitalize()}: {m.content.strip()}" for m in turns] + ["Assistant:"]
    return "\n\n".join(system + ["\n".join(lines)])


# ---------------------------------------------------------------- the HTTP side


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.headers = status, message, type, code, param, headers


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def speculative_stats(stats: Stats) -> dict:
    return {"drafted": stats.drafted, "accepted": stats.accepted, "acceptance_rate": round(stats.acceptance_rate, 4),
            "drafts_per_round": round(stats.drafts_per_round, 3), "target_calls": stats.target_calls,
            "tokens_per_second": round(stats.tokens_per_second, 2), "encoding_seconds": round(stats.encoding_seconds, 4)}


def create_app(models: Models, engine: Engine, defaults: Settings, name: str, api_key: str | None = None,
               max_prompt_tokens: int = 4096, max_body_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI(title="T5 speculative decoding", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(error_body(e.message, e.type, e.code, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message, where = "the body is not valid JSON", None
        if where and not message.startswith(where):
            message = f"{where}: {message}"
        return JSONResponse(error_body(message, "invalid_request_error", param=where or None), status_code=400)

    def guard(app):
        """Checks before a /v1/ request is read: the API key, the body's size
        (declared or counted as it comes) and shutdown. Plain ASGI: a
        BaseHTTPMiddleware would relay every streamed chunk through a task."""

        async def guarded(scope, receive, send):
            if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
                return await app(scope, receive, send)
            headers = dict(scope["headers"])
            refusal = None
            if api_key is not None and not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {api_key}".encode()):
                refusal = 401, error_body("a valid API key is needed (Authorization: Bearer KEY)", "invalid_request_error",
                                          "invalid_api_key")
            elif int(headers.get(b"content-length", b"0") or 0) > max_body_bytes:
                refusal = 413, error_body(f"the body is over {max_body_bytes:,} bytes", "invalid_request_error")
            elif engine.draining and scope["method"] == "POST":
                refusal = 503, error_body("the server is shutting down", "server_error")
            if refusal:
                return await JSONResponse(refusal[1], status_code=refusal[0])(scope, receive, send)
            received = 0

            async def counted():
                nonlocal received
                message = await receive()
                received += len(message.get("body", b""))
                if received > max_body_bytes:
                    raise ApiError(413, f"the body is over {max_body_bytes:,} bytes")
                return message

            return await app(scope, counted, send)

        return guarded

    app.add_middleware(lambda inner: guard(inner))

    def check_model(body: CompletionBody) -> None:
        if body.model not in (name, "default"):
            raise ApiError(400, f"model {body.model!r} is not served here (GET /v1/models: {name!r})", code="model_not_found",
                           param="model")

    def jobs_for(prompts: list[str], body: CompletionBody) -> list[Job]:
        try:
            settings = body.settings(defaults).check_models(models)
        except (OptionError, TypeError) as e:
            raise ApiError(400, str(e))
        loop = asyncio.get_running_loop()
        jobs = []
        for prompt in prompts:
            ids = models.tokenizer.encode(prompt)
            if len(ids) > max_prompt_tokens:
                raise ApiError(400, f"the prompt has {len(ids):,} tokens, more than this server's {max_prompt_tokens:,}",
                               code="context_length_exceeded", param="prompt")
            jobs.append(Job(ids, settings, body.ignore_eos, body.stop, loop, asyncio.Queue(), Detokenizer(models.tokenizer)))
        try:
            engine.submit(jobs)
        except QueueFull:
            raise ApiError(429, "the queue is full: try again shortly", "rate_limit_error", headers={"Retry-After": "1"})
        return jobs

    async def pieces(job: Job, request: Request | None = None):
        """(text, finish_reason) as the engine sends them, a piece a round. Given
        the request (no stream to notice it), a client gone is looked for
        every second; either way the job is cancelled if this ends early."""
        try:
            while True:
                if request is None:
                    item = await job.out.get()
                else:
                    try:
                        item = await asyncio.wait_for(job.out.get(), timeout=1.0)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                if item is None:
                    if job.error:
                        raise ApiError(500, job.error, "server_error")
                    return
                yield item
        finally:
            job.cancelled = job.cancelled or job.finish_reason is None

    def logged(request_id: str, jobs: list[Job], started: float) -> None:
        stats = sum((job.stats for job in jobs), Stats())
        log.info("%s prompt %d completion %d tokens, %.2f s, acceptance %.2f", request_id, stats.prompt_tokens,
                 stats.generated, time.perf_counter() - started, stats.acceptance_rate)

    def usage(jobs: list[Job]) -> dict:
        prompt, completion = sum(j.stats.prompt_tokens for j in jobs), sum(j.stats.generated for j in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def respond(request: Request, body: CompletionBody, prompts: list[str], chat: bool):
        check_model(body)
        jobs = jobs_for(prompts, body)
        request_id, created, started = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()), time.perf_counter()
        kind = "chat.completion" if chat else "text_completion"
        if not body.stream:
            texts = []
            for job in jobs:
                texts.append("".join([text async for text, _ in pieces(job, request)]))
            logged(request_id, jobs, started)
            choices = [{"index": i, "finish_reason": job.finish_reason,
                        **({"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None})}
                       for i, (job, text) in enumerate(zip(jobs, texts))]
            return {"id": request_id, "object": kind, "created": created, "model": name, "choices": choices,
                    "usage": usage(jobs), "speculative": speculative_stats(sum((j.stats for j in jobs), Stats()))}

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            data = {"id": request_id, "object": f"{kind}.chunk" if chat else kind, "created": created, "model": name,
                    "choices": [choice]}
            if finish is not None:
                data["speculative"] = speculative_stats(jobs[index].stats)
            return f"data: {json.dumps(data)}\n\n"

        async def choice_events(index: int, job: Job, out: asyncio.Queue | None = None):
            """A choice's chunks (into `out`, when choices interleave)."""
            try:
                async for text, finish in pieces(job):
                    item = chunk(index, text, finish)
                    yield item if out is None else await out.put(item)
            except ApiError as e:
                item = f"data: {json.dumps(error_body(e.message, e.type))}\n\n"
                yield item if out is None else await out.put(item)

        async def events():
            # Starlette cancels this generator when the client goes: the jobs are cancelled then.
            tasks = []
            try:
                if chat:
                    for i in range(len(jobs)):
                        yield chunk(i, None, None, first=True)
                if len(jobs) == 1:
                    async for item in choice_events(0, jobs[0]):
                        yield item
                else:
                    merged: asyncio.Queue = asyncio.Queue()

                    async def drain(index, job):
                        async for _ in choice_events(index, job, merged):
                            pass

                    tasks += [asyncio.create_task(drain(i, job)) for i, job in enumerate(jobs)]
                    finished = asyncio.gather(*tasks)
                    while not (finished.done() and merged.empty()):
                        getter = asyncio.ensure_future(merged.get())
                        await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
                        if getter.done():
                            yield getter.result()
                        else:
                            getter.cancel()
                if include_usage:
                    data = {"id": request_id, "object": f"{kind}.chunk" if chat else kind, "created": created,
                            "model": name, "choices": [], "usage": usage(jobs)}
                    yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"
                logged(request_id, jobs, started)
            finally:
                for task in tasks:
                    task.cancel()
                for job in jobs:
                    job.cancelled = job.cancelled or job.finish_reason is None

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, body: Completion):
        return await respond(request, body, [body.prompt] if isinstance(body.prompt, str) else body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletion):
        return await respond(request, body, [chat_prompt(body.messages)], chat=True)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "local"}]}

    @app.get("/health")
    async def health():
        if engine.draining or not engine.ready:
            return JSONResponse({"status": "draining" if engine.draining else "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return {"queued": len(engine.waiting), "active_rows": engine.active, "max_batch": engine.max_batch,
                "tokens_generated": engine.tokens, "tokens_per_second": round(engine.tokens_per_second(), 2),
                "rows_cancelled": engine.cancelled,
                "engine_seconds": {name: round(value, 3) for name, value in engine.seconds.items()}}

    return app


# ---------------------------------------------------------------- starting and stopping


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="target model: converted folder, a name under mlx_models/, or a hub id it was converted from")
    p.add_argument("--draft-model", help="draft model for speculative decoding (without it: prompt lookup if asked, else the target alone)")
    p.add_argument("--prompt-lookup", action="store_true", help="draft by prompt lookup unless a request says otherwise")
    p.add_argument("--name", help="the model name clients give (default: the target folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-batch", type=int, default=8, help="rows decoding at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; beyond, 429")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="longest prompt accepted")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    p.add_argument("--api-key", help="require this bearer token on /v1/ requests")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM")
    for name, knob in KNOBS.items():  # the requests' defaults
        p.add_argument(f"--{knob.flag}", type=str if knob.words else knob.type, help=knob.help + " (requests' default)")
    return p


def server_settings(args) -> Settings:
    """The requests' default settings, from the knob flags."""
    values = {name: getattr(args, name) for name in KNOBS if getattr(args, name) is not None}
    values = {name: KNOBS[name].parse(v, f"--{KNOBS[name].flag}") if isinstance(v, str) else KNOBS[name].check(v, f"--{KNOBS[name].flag}")
              for name, v in values.items()}
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
    except (T5Error, ModelNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or models.target_path.name
    engine = Engine(models, defaults, args.max_batch, args.max_queue)
    app = create_app(models, engine, defaults, name, args.api_key, args.max_prompt_tokens, args.max_body_bytes)
    log.info("serving %s on http://%s:%d (batches of %d, queue %d)", name, args.host, args.port, args.max_batch, args.max_queue)
    serve(engine, app, args.host, args.port, args.grace)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
