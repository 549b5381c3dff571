"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's audio endpoints, streamed as vLLM streams them.

A request's form (OpenAI's fields: file, model, language, prompt,
response_format, temperature, timestamp_granularities[], stream; the
decoding knobs and the long-form guards as extra fields) becomes a
`Listening` (speech.py) and one `AudioJob`: its file's windows join the
engine's batch one after another, beside other requests' rows, and its
segments' text goes out as each is decided. The answer is the transcription
in the format asked for (speech.render), or, streamed, its text in vLLM's
`transcription.chunk` events.
"""

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile

import audio
from errors import OptionError
from options import AUTO, KNOBS
from serving.engine import Engine, NeverFits, QueueFull
from serving.jobs import Job
from serving.guard import ApiError
from serving.metrics import Times
from serving.schema import BEAM_DEFAULTS, MAX_CHOICES
from serving.streams import Events, cancel_when_gone, pieces
from speech import FORMATS, Guards, Listening, Track, open_windows, render, row_cross
from text import TextStream

FORM_BYTES = 2**16  # a form's fields beside its file (the file's own limit: Limits.max_audio_bytes)


class AudioForm(BaseModel):
    """The form fields this server reads (they arrive as text, and are read
    as their types): OpenAI's, vLLM's `stream_include_usage`, and our
    decoding knobs, long-form guards and conditioning (openai-whisper's
    names). Other fields are ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str
    language: str | None = None
    prompt: str | None = None
    response_format: Literal[FORMATS] = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment", "word"]] = Field(["segment"], alias="timestamp_granularities[]")
    stream: bool = False
    stream_include_usage: bool = False
    max_tokens: int | None = Field(None, ge=1)
    num_draft: int | Literal["auto"] | None = None
    delta: float | None = None
    seed: int | None = None
    beam_size: int | None = Field(None, ge=1, le=MAX_CHOICES)  # openai-whisper's and faster-whisper's name: num_beams
    compression_ratio_threshold: float | None = Field(None, gt=0)
    logprob_threshold: float | None = None
    no_speech_threshold: float | None = Field(None, ge=0.0, le=1.0)
    temperature_increment_on_fallback: float | None = Field(None, gt=0.0, le=1.0)
    condition_on_previous_text: bool = False

    @field_validator("num_draft", "delta", "seed")
    @classmethod
    def in_range(cls, value, info):
        return value if value is None or value == AUTO else KNOBS[info.field_name].check(value, info.field_name)

    def options(self) -> dict:
        """The Settings fields this request sets (those it leaves out keep the server's)."""
        chosen = {"temp": self.temperature, "max_tokens": self.max_tokens, "num_draft": self.num_draft,
                  "delta": self.delta, "seed": self.seed, "num_beams": self.beam_size}
        return {name: value for name, value in chosen.items() if value is not None}

    def guards(self) -> Guards:
        return Guards.of(self.temperature, self.temperature_increment_on_fallback, self.compression_ratio_threshold,
                         self.logprob_threshold, self.no_speech_threshold)


@dataclass(eq=False)
class AudioJob(Job):
    """One file's transcription: its current window is the engine's request,
    and each next window follows once the last ends; its text is the
    decided segments'."""

    listening: Listening | None = None
    track: Track | None = None
    cross: tuple | None = None  # its window's row's cross-attention, as it ends (word times read it)

    def ending(self, batch, request) -> None:
        if self.listening.words and not self.cancelled:  # (nobody waits for the words of a job whose client left)
            self.cross = row_cross(batch, request)

    def add(self, token: int | None, finish: str | None) -> None:
        said = self.listening.token(self.track, token)
        if finish is not None:
            said += self.listening.ended(self.track, finish, self.cross)
            self.cross = None
        for segment in said:
            for token in segment["tokens"]:
                if token < self.listening.whisper.end:  # its text: no timestamps
                    self.stream.add(token)
        if self.track.done:
            self.stream.add(None, self.track.finish or finish)

    @property
    def stats(self):
        return self.track.stats

    @property
    def prompt_tokens(self) -> int:
        return 0  # audio, counted in seconds (audio_seconds)

    def follow(self):
        if self.track.done:
            return None
        self.request = self.listening.window(self.track)
        return self.request

    @staticmethod
    def encoded(models, cache, jobs: list["AudioJob"]) -> None:
        open_windows(models, cache, [job.track for job in jobs])

    def again(self):
        """Its window anew, its tokens so far to be decided again (and checked) first."""
        request = super().again()
        self.replay = list(self.track.window.tokens)
        self.track.window.request = request
        return request


class Transcriptions:
    """What both audio endpoints do with a request: its job, then its answer.
    Reading a file and making its features takes memory and a core for a
    while: PREPARING requests at a time do it, and none while the queue is
    full."""

    PREPARING = 2

    def __init__(self, models, engine: Engine, check_model, max_seconds: float):
        self.models, self.engine, self.check_model, self.max_seconds = models, engine, check_model, max_seconds
        self.preparing = asyncio.Semaphore(self.PREPARING)

    def queue_full(self) -> ApiError:
        return ApiError(429, "the queue is full: try again shortly", "rate_limit_error", headers={"Retry-After": "1"})

    async def answer(self, request: Request, task: str):
        arrived = request.state.arrived
        body, data = await self.form(request)
        self.check_model(body.model)
        async with self.preparing:
            if len(self.engine.waiting) >= self.engine.max_queue:  # before the work, not after
                raise self.queue_full()
            listening, track = await asyncio.to_thread(self.prepared, body, data, task)
        loop = asyncio.get_running_loop()
        job = AudioJob(listening.window(track), TextStream(self.models.tokenizer), loop, asyncio.Queue(),
                       times=Times(arrived), listening=listening, track=track)
        try:
            self.engine.submit([job])
        except QueueFull:
            raise self.queue_full()
        except NeverFits as e:
            raise ApiError(400, f"the file can never be transcribed here: {e}", param="file")
        self.engine.metrics.audio_seconds.inc(track.duration)
        name = body.model
        if body.stream:
            return Events(self.stream(job, name, body.stream_include_usage), [job])
        watcher = asyncio.create_task(cancel_when_gone([job], request.receive))
        try:
            async for _ in pieces(job):
                pass
        finally:
            watcher.cancel()
            job.cancel()
        rendered = render(listening.transcription(track), body.response_format)
        if body.response_format in ("json", "verbose_json"):
            usage = {"type": "duration", "seconds": math.ceil(track.duration)}
            return JSONResponse(json.loads(rendered) | {"usage": usage})
        return PlainTextResponse(rendered, media_type="text/vtt" if body.response_format == "vtt" else "text/plain")

    async def form(self, request: Request) -> tuple[AudioForm, bytes]:
        """The form's fields, checked, and the file's bytes."""
        try:
            form = await request.form(max_files=1, max_fields=64, max_part_size=FORM_BYTES)
        except Exception as e:  # not a multipart (or urlencoded) form, or one past its limits
            raise ApiError(400, f"the body is not a form this endpoint reads (multipart/form-data): {e}")
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "file: an audio file is required (a multipart/form-data upload)", param="file")
            fields = {key: value for key, value in form.multi_items() if key != "file" and isinstance(value, str)}
            if "timestamp_granularities[]" in fields:
                fields["timestamp_granularities[]"] = form.getlist("timestamp_granularities[]")
            try:
                body = AudioForm.model_validate(fields)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(part) for part in first.get("loc", ()))
                raise ApiError(400, f"{where}: {first.get('msg', 'invalid')}".removeprefix(": "), param=where or None)
            return body, await upload.read()
        finally:
            await form.close()  # the upload's spooled file

    def prepared(self, body: AudioForm, data: bytes, task: str) -> tuple[Listening, Track]:
        """The request's Listening and its file's Track (read, and its features made): off the event loop."""
        try:
            options = body.options()
            timestamps = body.response_format in ("srt", "vtt", "verbose_json")
            words = "word" in body.timestamp_granularities
            if words and body.response_format != "verbose_json":
                raise OptionError("word timestamps come in verbose_json: ask for that response_format",
                                  "timestamp_granularities[]")
            defaults = self.engine.defaults
            if options.get("num_beams", 1) > 1:  # greedy and draftless under the request's own fields
                defaults = replace(defaults, **BEAM_DEFAULTS)
            listening = Listening.of(self.models, body.language, task, timestamps, body.guards(), body.prompt,
                                     defaults, set(options), options, words, body.condition_on_previous_text)
            return listening, listening.track(data, self.max_seconds)
        except audio.AudioError as e:
            raise ApiError(400, f"file: {e}", param="file")
        except OptionError as e:
            param = "timestamp_granularities[]" if e.param == "words" else e.param
            raise ApiError(400, str(e), param=param)

    async def stream(self, job: AudioJob, name: str, include_usage: bool):
        """vLLM's `transcription.chunk` events: the text of each segment as it
        is decided, the finish reason with the last, the usage if asked, then
        [DONE]."""
        call, created = f"trsc-{uuid.uuid4().hex[:24]}", int(time.time())

        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        try:
            async for piece, finish, _ in pieces(job):
                choice = {"delta": {"content": piece}, "finish_reason": finish, "stop_reason": None}
                yield event({"id": call, "object": "transcription.chunk", "created": created, "model": name,
                             "choices": [choice]})
        except ApiError as e:
            yield event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            return
        if include_usage:
            generated = job.stats.generated
            yield event({"id": call, "object": "transcription.chunk", "created": created, "model": name, "choices": [],
                         "usage": {"prompt_tokens": 0, "completion_tokens": generated, "total_tokens": generated,
                                   "audio_seconds": round(job.track.duration, 3)}})
        yield "data: [DONE]\n\n"
