"""The HTTP side: a guard in front of the routes, and each request's answer, whole or streamed.

A request's prompts become jobs for the engine (engine.py); `complete` waits
for every job's text and answers once, `stream` sends each piece as a
server-sent event as the engine publishes it. Errors reach the client in
OpenAI's error shape (shapes.py) with the status OpenAI's clients expect.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

import decoder
from errors import OptionError
from loading import Models
from options import Stats
from serving import shapes
from serving.engine import Engine, Job, QueueFull
from serving.schema import ChatCompletion, Completion, CompletionBody
from text import TextStream

log = logging.getLogger("t5-server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.headers = status, message, type, code, param, headers


class Guard:
    """Checks before a /v1/ request is read: the API key, the body's size
    (declared, or counted as it comes) and shutdown. Plain ASGI: a
    BaseHTTPMiddleware would relay every streamed chunk through a task."""

    def __init__(self, app, engine: Engine, api_key: str | None, max_body_bytes: int):
        self.app, self.engine, self.api_key, self.max_body_bytes = app, engine, api_key, max_body_bytes

    def refusal(self, scope) -> tuple[int, dict] | None:
        headers = dict(scope["headers"])
        expected = f"Bearer {self.api_key}".encode()
        if self.api_key is not None and not hmac.compare_digest(headers.get(b"authorization", b""), expected):
            return 401, shapes.error_body("a valid API key is needed (Authorization: Bearer KEY)", "invalid_request_error",
                                          "invalid_api_key")
        if int(headers.get(b"content-length", b"0") or 0) > self.max_body_bytes:
            return 413, shapes.error_body(f"the body is over {self.max_body_bytes:,} bytes", "invalid_request_error")
        if self.engine.draining and scope["method"] == "POST":
            return 503, shapes.error_body("the server is shutting down", "server_error")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused:
            return await JSONResponse(refused[1], status_code=refused[0])(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise ApiError(413, f"the body is over {self.max_body_bytes:,} bytes")
            return message

        return await self.app(scope, counted, send)


@dataclass
class Call:
    """One request's answer in the making: its id and time, and a job per prompt."""

    chat: bool
    jobs: list[Job]
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    @property
    def stats(self) -> Stats:
        return sum((job.request.stats for job in self.jobs), Stats())

    @property
    def usage(self) -> dict:
        """Tokens the prompts took, and tokens whose text the client received."""
        return shapes.usage(sum(len(job.request.ids) for job in self.jobs), sum(job.stream.received for job in self.jobs))

    def log(self) -> None:
        stats = self.stats
        log.info("%s prompt %d completion %d tokens, %.2f s, acceptance %.2f", self.id, stats.prompt_tokens,
                 self.usage["completion_tokens"], time.perf_counter() - self.started, stats.acceptance_rate)


async def pieces(job: Job, request: Request | None = None):
    """(text, finish_reason) as the engine sends them, a piece a round. Given
    the request (no stream to notice it), a client gone is looked for every
    second; either way the job is cancelled if this ends early."""
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
        job.cancelled = job.cancelled or job.stream.finish_reason is None


class Completions:
    """What both endpoints do with a request: its jobs, then its answer."""

    def __init__(self, models: Models, engine: Engine, name: str, max_prompt_tokens: int):
        self.models, self.engine, self.name, self.max_prompt_tokens = models, engine, name, max_prompt_tokens

    def jobs_for(self, body: CompletionBody) -> list[Job]:
        if body.model not in (self.name, "default"):
            raise ApiError(400, f"model {body.model!r} is not served here (GET /v1/models: {self.name!r})",
                           code="model_not_found", param="model")
        try:
            settings = body.settings(self.engine.defaults).check_models(self.models)
        except (OptionError, TypeError) as e:
            raise ApiError(400, str(e))
        loop, jobs = asyncio.get_running_loop(), []
        for prompt in body.prompts:
            ids = self.models.tokenizer.encode(prompt)
            if len(ids) > self.max_prompt_tokens:
                raise ApiError(400, f"the prompt has {len(ids):,} tokens, more than this server's {self.max_prompt_tokens:,}",
                               code="context_length_exceeded", param="prompt")
            stream = TextStream(self.models.tokenizer, settings.stop)
            jobs.append(Job(decoder.Request(ids, settings), stream, loop, asyncio.Queue()))
        try:
            self.engine.submit(jobs)
        except QueueFull:
            raise ApiError(429, "the queue is full: try again shortly", "rate_limit_error", headers={"Retry-After": "1"})
        return jobs

    async def answer(self, request: Request, body: CompletionBody, chat: bool):
        call = Call(chat, self.jobs_for(body))
        if body.stream:
            return StreamingResponse(self.stream(call, body.include_usage), media_type="text/event-stream")
        return await self.complete(call, request)

    async def complete(self, call: Call, request: Request) -> dict:
        choices = []
        for job in call.jobs:
            text = "".join([piece async for piece, _ in pieces(job, request)])
            choices.append((text, job.stream.finish_reason))
        call.log()
        return shapes.completion(call.id, call.created, self.name, call.chat, choices, call.usage, call.stats)

    async def stream(self, call: Call, include_usage: bool):
        """Server-sent events: a chat's role chunks, each choice's pieces as
        they come (interleaved when there are several), the usage if asked,
        then [DONE]. Starlette cancels this generator when the client goes:
        the jobs are cancelled then."""
        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        try:
            if call.chat:
                for i in range(len(call.jobs)):
                    yield event(shapes.chunk(call.id, call.created, self.name, True, i, None, None, first=True))
            async for index, piece, finish in interleaved(call.jobs):
                if index is None:  # an error event
                    yield event(piece)
                    continue
                stats = call.jobs[index].request.stats if finish else None
                yield event(shapes.chunk(call.id, call.created, self.name, call.chat, index, piece, finish, stats=stats))
            if include_usage:
                yield event(shapes.usage_chunk(call.id, call.created, self.name, call.chat, call.usage))
            yield "data: [DONE]\n\n"
            call.log()
        finally:
            for job in call.jobs:
                job.cancelled = job.cancelled or job.stream.finish_reason is None


async def interleaved(jobs: list[Job]):
    """(choice index, text, finish reason) from every job as each comes;
    (None, error body, None) for a job that failed."""
    if len(jobs) == 1:  # no tasks to interleave
        try:
            async for piece, finish in pieces(jobs[0]):
                yield 0, piece, finish
        except ApiError as e:
            yield None, shapes.error_body(e.message, e.type), None
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, job: Job):
        try:
            async for piece, finish in pieces(job):
                await merged.put((index, piece, finish))
        except ApiError as e:
            await merged.put((None, shapes.error_body(e.message, e.type), None))

    tasks = [asyncio.create_task(drain(i, job)) for i, job in enumerate(jobs)]
    finished = asyncio.gather(*tasks)
    try:
        while not (finished.done() and merged.empty()):
            getter = asyncio.ensure_future(merged.get())
            await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
    finally:
        for task in tasks:
            task.cancel()


def create_app(models: Models, engine: Engine, name: str, api_key: str | None = None, max_prompt_tokens: int = 4096,
               max_body_bytes: int = 1 << 20) -> FastAPI:
    """The routes: completions and chat, models, health and metrics, behind the guard."""
    app = FastAPI(title="T5 speculative decoding", docs_url=None, redoc_url=None)
    completions = Completions(models, engine, name, max_prompt_tokens)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_middleware(Guard, engine=engine, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.post("/v1/completions")
    async def completion(request: Request, body: Completion):
        return await completions.answer(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completion(request: Request, body: ChatCompletion):
        return await completions.answer(request, body, chat=True)

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
                "engine_seconds": {part: round(value, 3) for part, value in engine.seconds.items()}}

    return app


async def api_error(request: Request, e: ApiError):
    return JSONResponse(shapes.error_body(e.message, e.type, e.code, e.param), status_code=e.status, headers=e.headers)


async def invalid_request(request: Request, e: RequestValidationError):
    first = e.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        message, where = "the body is not valid JSON", None
    if where and not message.startswith(where):
        message = f"{where}: {message}"
    return JSONResponse(shapes.error_body(message, "invalid_request_error", param=where or None), status_code=400)
