"""The routes, behind the guard (guard.py), and each request's answer, whole or streamed.

A request's prompts become jobs for the engine (engine.py); `complete` waits
for every job's text and answers once, `stream` sends each piece as a
server-sent event as the engine publishes it. Errors reach the client in
OpenAI's error shape (shapes.py) with the status OpenAI's clients expect.
"""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from errors import OptionError
from loading import Models
from options import Stats
from plans import Plan, PromptForm, resolve, with_presets
from serving import shapes
from serving.engine import Engine, NeverFits, QueueFull
from serving.jobs import Job
from serving.streams import Events, cancel_when_gone, interleaved, pieces
from serving.guard import Access, ApiError, Guard
from serving.metrics import Times
from serving.transcriptions import FORM_BYTES, Transcriptions
from serving.schema import (BEAM_DEFAULTS, CHARACTERS_PER_TOKEN, ChatCompletion, Completion, CompletionBody, Detokenize,
                            Prompt, Tokenize)
from text import TextStream, token_text

log = logging.getLogger("t5-server")


@dataclass
class Call:
    """One request's answer in the making: its id and time, and a job per prompt."""

    shapes: shapes.Shapes  # the endpoint's
    jobs: list[Job]
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.id = f"{self.shapes.id_prefix}-{uuid.uuid4().hex[:24]}"

    @property
    def stats(self) -> Stats:
        return sum((job.request.stats for job in self.jobs), Stats())

    @property
    def usage(self) -> dict:
        """Tokens the prompts took (each prompt once), and tokens whose text the client received (every beam returned)."""
        prompts = {id(job.request.source): len(job.request.source) for job in self.jobs}
        received = sum(sum(beam.received for beam in job.beams) if job.beams else job.stream.received for job in self.jobs)
        return shapes.usage(sum(prompts.values()), received)

    def log(self, client_left: bool = False) -> None:
        """A line for the answer once it has ended: sent whole, or cut short because its client left."""
        stats = self.stats
        log.info("%s prompt %d completion %d tokens, %.2f s, acceptance %.2f%s", self.id, stats.prompt_tokens,
                 self.usage["completion_tokens"], time.perf_counter() - self.started, stats.acceptance_rate,
                 "; the client left before the end: not sent" if client_left else "")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (server.py's options)."""

    max_prompt_tokens: int = 4096  # a prompt's tokens
    max_tokens: int = 4096  # max_tokens
    max_request_tokens: int | None = None  # over its prompts: prompt tokens + max_tokens (the cache its rows hold)
    max_audio_bytes: int = 25 * 2**20  # an audio file's (OpenAI's limit)
    max_audio_seconds: float = 3600.0  # and its length: its features are held while it decodes


class Completions:
    """What both endpoints do with a request: its jobs, then its answer."""

    def __init__(self, models: Models, engine: Engine, names: list[str], limits: Limits):
        self.models, self.engine, self.names, self.limits = models, engine, names, limits

    @property
    def name(self) -> str:
        return self.names[0]

    def check_model(self, model: str | None) -> None:
        """A model this server serves, or a 404 (None: /tokenize's may be left out)."""
        if model is not None and model not in (*self.names, "default"):
            raise ApiError(404, f"the model {model!r} does not exist here (GET /v1/models: {self.name!r})",
                           code="model_not_found", param="model")

    def plan(self, body: CompletionBody) -> Plan:
        """The request's plan: its options, over its task's, over the server's (with the model's generation
        defaults), resolved against the models."""
        self.check_model(body.model)
        if self.models.target.args.num_mel_bins:
            raise ApiError(400, f"{self.name} transcribes audio: POST /v1/audio/transcriptions or "
                                "/v1/audio/translations", param="model")
        try:
            # a task's beam search: as use_beam_search asks for one, its n beams returned
            prefix, defaults, _ = with_presets(self.models, self.engine.defaults, task=body.task, generation=False,
                                               searching=BEAM_DEFAULTS | {"num_return_sequences": body.n})
            if body.use_beam_search:
                defaults = replace(defaults, **BEAM_DEFAULTS)
            plan = resolve(body.settings(defaults), self.models, prefix)
        except OptionError as e:  # the request's own names: temperature for temp
            raise ApiError(400, str(e), param={"temp": "temperature"}.get(e.param, e.param))
        except TypeError as e:
            raise ApiError(400, str(e))
        settings = plan.settings
        if settings.num_beams == 1 and (body.length_penalty is not None or body.early_stopping is not None):
            raise ApiError(400, "length_penalty and early_stopping go with beam search (use_beam_search)",
                           param="length_penalty" if body.length_penalty is not None else "early_stopping")
        if settings.num_beams > 1 and body.stream:
            raise ApiError(400, "beam search does not stream: its best beams are known only at the end", param="stream")
        if settings.max_tokens > self.limits.max_tokens:
            field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
            raise ApiError(400, f"{field} is {settings.max_tokens:,}, more than this server's {self.limits.max_tokens:,}",
                           param=field)
        return plan

    def encode(self, prompts: list[Prompt], truncate: int | None = None, copies: int = 1,
               form: PromptForm = PromptForm(), param: str = "prompt") -> list[list[int]]:
        """Each prompt's ids: a text tokenized in the request's form (a
        task's prefix, a source language), ids checked against the
        vocabulary; with `truncate` (vLLM's truncate_prompt_tokens), only
        the last so many, as a long document is cut to fit."""
        if len(prompts) * copies > self.engine.max_queue:
            raise ApiError(400, f"{len(prompts) * copies} rows ({len(prompts)} prompts, {copies} each) are more than this "
                                f"server's queue holds ({self.engine.max_queue}): send fewer prompts, or a smaller n",
                           param="prompt")
        encoded = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = self.text_ids(self.within_limit(prompt, param), form, truncate)
            else:
                ids = self.known(prompt, "prompt")
                ids = ids[-truncate:] if truncate else ids
            most = self.max_prompt_tokens
            if len(ids) > most:
                raise ApiError(400, f"the prompt has {len(ids):,} tokens, more than this server's {most:,} "
                                    "(truncate_prompt_tokens keeps its last ones)",
                               code="context_length_exceeded", param="prompt")
            encoded.append(ids)
        return encoded

    def within_limit(self, text: str, param: str) -> str:
        """A prompt's text, if no longer than the server's prompt limit allows
        (CHARACTERS_PER_TOKEN a token) before it is tokenized; a 400 otherwise."""
        most = self.max_prompt_tokens * CHARACTERS_PER_TOKEN
        if len(text) > most:
            raise ApiError(400, f"the prompt has {len(text):,} characters, more than this server takes ({most:,}, "
                                f"{CHARACTERS_PER_TOKEN} a token of its {self.max_prompt_tokens:,})",
                           code="context_length_exceeded", param=param)
        return text

    @property
    def max_prompt_tokens(self) -> int:
        """The server's prompt limit, or the models' positions' end if nearer."""
        return min(self.limits.max_prompt_tokens, self.models.longest_input or self.limits.max_prompt_tokens)

    def text_ids(self, text: str, form: PromptForm = PromptForm(), keep: int | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        try:
            if not add_special_tokens:
                return self.models.tokenizer.encode(text, add_special_tokens=False)
            return form.ids(self.models, text, keep)
        except Exception as e:  # the Rust tokenizer's errors have no common type
            raise ApiError(400, f"the prompt could not be tokenized ({str(e).splitlines()[0]})", param="prompt")

    def known(self, ids: list[int], param: str) -> list[int]:
        """Token ids a client gave, if the vocabulary has them."""
        vocabulary = len(self.models.tokenizer)
        if not all(0 <= token < vocabulary for token in ids):
            raise ApiError(400, f"token ids must be in [0, {vocabulary})", param=param)
        return list(ids)

    def prepared(self, body: CompletionBody) -> tuple[Plan, list[list[int]], int]:
        """The request's plan, its prompts' ids, and the jobs each prompt takes (n samples, or one search of n
        beams); checked against the server's limits. Its cost grows with the prompts: off the event loop."""
        plan = self.plan(body)
        settings = plan.settings
        copies = 1 if settings.num_beams > 1 else body.n
        encoded = self.encode(body.prompts, body.truncate_prompt_tokens, copies, plan.form, body.prompt_field)
        needed = sum(len(ids) + settings.max_tokens for ids in encoded) * copies * settings.num_beams
        if self.limits.max_request_tokens is not None and needed > self.limits.max_request_tokens:
            raise ApiError(400, f"the request would hold {needed:,} tokens in its rows' caches (each prompt's tokens "
                                f"and max_tokens), more than this server's {self.limits.max_request_tokens:,}: "
                                "send fewer prompts, or a smaller max_tokens", code="context_length_exceeded")
        return plan, encoded, copies

    def jobs_for(self, plan: Plan, encoded: list[list[int]], copies: int, arrived: float) -> list[Job]:
        settings = plan.settings
        loop = asyncio.get_running_loop()
        jobs = [Job(plan.request(ids, copy), TextStream.of(self.models.tokenizer, settings), loop, asyncio.Queue(),
                    times=Times(arrived)) for ids in encoded for copy in replace(settings, n=copies).copies()]
        try:
            self.engine.submit(jobs)
        except QueueFull:
            raise ApiError(429, "the queue is full: try again shortly", "rate_limit_error", headers={"Retry-After": "1"})
        except NeverFits as e:
            raise ApiError(400, f"the request can never run here: {e}", code="context_length_exceeded")
        return jobs

    def logprobs(self, job: Job, shown_as: shapes.Shapes, start: int, stop: int) -> dict | None:
        """The logprobs of a job's tokens start..stop-1 in OpenAI's shape; None unless asked for."""
        if job.request.settings.logprobs is None:
            return None
        tokenizer, tokens, shown = self.models.tokenizer, job.stream.tokens, []
        skip = job.request.settings.skip_special_tokens  # special tokens show as "" when the text leaves them out
        for i in range(start, stop):
            logprob, top = job.request.logprobs[i]
            before = tokens[max(i - 4, 0) : i]
            alternatives = [(token_text(tokenizer, before, t, skip), v) for t, v in top]
            shown.append((token_text(tokenizer, before, tokens[i], skip), logprob, alternatives))
        return shown_as.logprobs(shown, job.stream.starts[start:stop])

    async def answer(self, request: Request, body: CompletionBody, shown_as: shapes.Shapes):
        prepared = await asyncio.to_thread(self.prepared, body)
        call = Call(shown_as, self.jobs_for(*prepared, request.state.arrived))
        if body.stream:
            return Events(self.stream(call, body.include_usage), call.jobs)
        return await self.complete(call, request)

    async def complete(self, call: Call, request: Request) -> dict:
        """The whole answer, once every job has ended; a client that leaves
        first (no stream to notice it) cancels them."""
        watcher = asyncio.create_task(cancel_when_gone(call.jobs, request.receive))
        try:
            choices = []
            for job in call.jobs:
                text = "".join([piece async for piece, _, _ in pieces(job)])
                if job.request.sequences:  # beam search: the best beams, as texts (stop strings cut them as they cut text)
                    for tokens, _, finish in job.request.sequences:
                        job.beams.append(TextStream.of(self.models.tokenizer, job.request.settings))
                        choices.append((job.beams[-1].whole(tokens, finish), job.beams[-1].finish_reason, None))
                else:
                    choices.append((text, job.stream.finish_reason, self.logprobs(job, call.shapes, 0, job.stream.received)))
        finally:  # a job failed, or this was cancelled: the others stop too
            client_left = watcher.done() and not watcher.cancelled()  # it saw the disconnect
            watcher.cancel()
            for job in call.jobs:
                job.cancel()
        call.log(client_left)
        return call.shapes.completion(call.id, call.created, self.name, choices, call.usage, call.stats)

    async def stream(self, call: Call, include_usage: bool):
        """Server-sent events: each choice's opening chunk, if its endpoint
        sends one (chat's role), each choice's pieces as they come
        (interleaved when there are several), the usage if asked, then
        [DONE]. Starlette cancels this generator when the client goes: the
        response (Events) cancels the jobs then."""
        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        def chunk(choice: dict, stats=None) -> str:
            return event(call.shapes.chunk(call.id, call.created, self.name, choice, stats, with_usage=include_usage))

        ended = False
        try:
            for i in range(len(call.jobs)):
                if (opening := call.shapes.opening(i)) is not None:
                    yield chunk(opening)
            sent = [0] * len(call.jobs)  # each choice's tokens whose logprobs went out
            async for index, piece, finish, settled in interleaved(call.jobs):
                if index is None:  # an error event
                    yield event(piece)
                    continue
                job = call.jobs[index]
                given = self.logprobs(job, call.shapes, sent[index], settled)
                sent[index] = settled
                yield chunk(call.shapes.piece(index, piece, finish, given), job.request.stats if finish else None)
            if include_usage:
                yield event(call.shapes.usage_chunk(call.id, call.created, self.name, call.usage))
            yield "data: [DONE]\n\n"
            ended = True
        finally:  # also when Starlette cancels this because the client left
            call.log(client_left=not ended)


OTHER_BODY_BYTES = 4096  # a body sent to a path no route takes: it is refused whole, so none needs to be read
UPLOAD_BYTES_PER_SECOND = 125_000  # the slowest upload an audio route waits for: 1 Mbit/s


def create_app(models: Models, engine: Engine, names: list[str], access: Access = Access(), limits: Limits = Limits(),
               max_body_bytes: int = 1 << 20, read_timeout: float = 30.0) -> FastAPI:
    """The routes: completions and chat, audio, models, health and metrics, behind the guard."""
    app = FastAPI(title="T5 speculative decoding", docs_url=None, redoc_url=None)
    app.state.metrics = engine.metrics
    completions = Completions(models, engine, names, limits)
    transcriptions = Transcriptions(models, engine, completions.check_model, limits.max_audio_seconds)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected_error)
    # Each route's body limit: the text routes take max_body_bytes; a path no route takes, what an error needs.
    body_limits = {path: max_body_bytes for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")}
    audio_paths = [f"/v1/audio/{task}s" for task in ("transcription", "translation")]
    body_limits |= {path: limits.max_audio_bytes + FORM_BYTES for path in audio_paths}
    # An upload's body may take longer than the read timeout: as long again as it takes at 1 Mbit/s.
    body_seconds = {path: read_timeout + limits.max_audio_bytes / UPLOAD_BYTES_PER_SECOND for path in audio_paths}
    app.add_middleware(Guard, engine=engine, access=access, max_body_bytes=min(max_body_bytes, OTHER_BODY_BYTES),
                       read_timeout=read_timeout, body_limits=body_limits, body_seconds=body_seconds)

    @app.post("/v1/completions")
    async def completion(request: Request, body: Completion):
        return await completions.answer(request, body, shapes.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completion(request: Request, body: ChatCompletion):
        return await completions.answer(request, body, shapes.CHAT)

    @app.post("/v1/audio/transcriptions")
    async def transcription(request: Request):
        return await transcriptions.answer(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translation(request: Request):
        return await transcriptions.answer(request, "translate")

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        """vLLM's: the prompt's ids as a completion would take them (the server's prompt limit beside them)."""
        completions.check_model(body.model)

        def tokenized():  # off the event loop: its cost grows with the text
            ids = completions.text_ids(completions.within_limit(body.text, "prompt" if body.prompt is not None
                                                                else "messages"), add_special_tokens=body.add_special_tokens)
            strings = [models.tokenizer.decode([token]) for token in ids] if body.return_token_strs else None
            return shapes.tokenized(ids, completions.max_prompt_tokens, strings)

        return await asyncio.to_thread(tokenized)

    @app.post("/detokenize")
    async def detokenize(body: Detokenize):
        completions.check_model(body.model)
        ids = completions.known(body.tokens, "tokens")
        return shapes.detokenized(await asyncio.to_thread(models.tokenizer.decode, ids))

    @app.get("/v1/models")
    async def list_models():
        return shapes.model_list(names)

    @app.get("/health")
    async def health():
        if engine.draining or not engine.ready:
            return JSONResponse({"status": "draining" if engine.draining else "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        text, content_type = engine.metrics.exposition(request.headers.get("accept"))
        return Response(text, headers={"Content-Type": content_type})

    return app


async def api_error(request: Request, e: ApiError):
    return e.response(request.app.state.metrics)


async def unexpected_error(request: Request, e: Exception):
    """A bug's 500, in OpenAI's shape too (Starlette logs its traceback); the connection closes, as whatever failed
    may have left it mid-request."""
    return ApiError(500, f"the server failed: {type(e).__name__}", "server_error").response(request.app.state.metrics)


async def http_error(request: Request, e: StarletteHTTPException):
    """Starlette's own errors (404, 405, a body it could not parse) in OpenAI's shape."""
    message = str(e.detail)
    if e.status_code == 400 and "parsing the body" in message:  # FastAPI's words for a body json.loads refused
        message = "the body could not be read as JSON (not UTF-8, or nested too deeply)"
    return ApiError(e.status_code, message, code="not_found" if e.status_code == 404 else None,
                    headers=getattr(e, "headers", None)).response(request.app.state.metrics)


def union_member(part) -> bool:
    """A step of pydantic's error location that names a type a union tried ("float", "list[TextPart]"), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


async def invalid_request(request: Request, e: RequestValidationError):
    """The first error, our own messages (value errors) before pydantic's type errors."""
    errors = e.errors()
    first = next((error for error in errors if error.get("type") == "value_error"), errors[0])
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body" and not union_member(part))
    where = where or getattr(first.get("ctx", {}).get("error"), "param", None)  # a model check's FieldError names it
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        message, where = "the body is not valid JSON", None
    if where and not message.startswith(where):
        message = f"{where}: {message}"
    return ApiError(400, message, param=where or None).response(request.app.state.metrics)
