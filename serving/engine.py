"""The thread that owns MLX: requests wait in a bounded queue, join free rows between rounds, and leave when done.

Each prompt of a request is a `Job` (serving/jobs.py): the engine's `Request` (its ids and Settings), the `TextStream`
that turns its tokens into text, and the queue of pieces it sends back to the request's event loop. Rows of one
drafting kind (Settings.kind) share a batch made by batches.batch_for, and batches of different kinds take rounds in
turn; a kind's short requests (EXPRESS_TOKENS) have a batch of their own, whose rounds go first.
"""

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx

from batches import batch_for, warm_up
from generate import encoding_flops
from errors import StageError, T5Error
from model import ROWS_PER_CHUNK
from rows import Encoding
from loading import Models
from options import Settings
from serving.budget import Budget
from serving.jobs import Job
from serving.metrics import PREFIX, Metrics

log = logging.getLogger("t5-server")


class QueueFull(Exception):
    pass


class NeverFits(Exception):
    """A job whose rows could hold more than the whole cache budget: it is refused, not queued."""

    def __init__(self, needed: int, limit: int):
        super().__init__(f"its rows could come to hold {needed / 2**30:.2f} GiB of cache (its prompt's and max_tokens' "
                         f"positions, in every decoder layer), more than this server's budget of {limit / 2**30:.2f} "
                         "GiB (--cache-memory): send a shorter prompt, or a smaller max_tokens")


# What a step's encoding takes when no row decodes: the queue is read between slices, so that a short prompt sent after
# a long one starts decoding while the long one is still encoded.
ENCODING_SLICE = 0.05
# While rows decode, a step's encoding takes at most this many times as long as its rounds: rows waiting for their
# prompts get time against the rows decoding, but a crowd of them does not stop the decoding rows for seconds.
ENCODING_SHARE_MOST = 8.0
# Requests of at most this many tokens (a label, a yes or a no) decode in a batch of their own whose rounds go first: a
# round's time grows with its rows (on a CPU nearly row for row), and a short request among long ones would wait a long
# round for each of its few tokens. The other batches sit out at most EXPRESS_ROUNDS_MOST of its rounds in a row: a
# flood of short requests slows the long ones down, and does not stop them.
EXPRESS_TOKENS = 16
EXPRESS_ROUNDS_MOST = 2


@dataclass(frozen=True)
class Express:
    """The key of the batch of a drafting kind's requests of at most EXPRESS_TOKENS tokens."""

    kind: object


def express(job: Job) -> bool:
    """Whether a job's rows decode in its kind's Express batch."""
    return job.request.settings.max_tokens <= EXPRESS_TOKENS


@dataclass(eq=False)
class Joining:
    """Jobs of one drafting kind whose prompts are encoded together (a piece a step), to join its batch then."""

    kind: object
    jobs: list[Job]
    encoding: Encoding
    queued: bool = False  # its jobs came from the queue (not an audio file's next window, nor a job decoded again)
    flops: float = 0.0  # its encoders' work (generate.encoding_flops), by which the engine guesses how long it takes

    @property
    def size(self) -> tuple[int, int]:
        return size_class(max(len(job.request.source) for job in self.jobs),
                          max(job.request.settings.max_tokens for job in self.jobs))


def encoding_time(round_seconds: float, joining_rows: int, decoding_rows: int) -> float:
    """A step's time for encoding: as long as its rounds took (round_seconds; 0 when no row decodes: ENCODING_SLICE),
    times the rows waiting for their prompts over the rows decoding where those are more (row for row), up to
    ENCODING_SHARE_MOST times."""
    if not round_seconds:
        return ENCODING_SLICE
    return max(round_seconds, 1e-3) * min(ENCODING_SHARE_MOST, max(1.0, joining_rows / max(1, decoding_rows)))


def size_class(prompt_length: int, max_tokens: int) -> tuple[int, int]:
    """How long a prompt is, then how many tokens its request asks for, on a doubling scale (one class for prompts of
    up to a chunk of rows): jobs of one class encode together, and the smaller classes first."""
    return 0 if prompt_length <= ROWS_PER_CHUNK else prompt_length.bit_length(), max_tokens.bit_length()


def fatal(error: Exception) -> None:
    """Raise what no request can survive: a pipeline stage lost (errors.StageError), which ends the engine's run and
    the server with one line, rather than failing every request after it."""
    if isinstance(error, StageError):
        raise error


class Engine:
    """What the thread that owns MLX (the main thread) runs. Jobs wait in a bounded queue; between rounds they join free
    rows (encoded together, by drafting kind), and finished or cancelled rows leave. An exception in a round fails that
    batch's jobs only. `draining` turns new jobs away while the ones taken finish."""

    def __init__(self, models: Models, defaults: Settings, max_batch: int, max_queue: int, name: str = "model",
                 warm: Callable | None = None, metrics_prefix: str = PREFIX, budget: Budget | None = None):
        self.models, self.defaults, self.max_batch, self.max_queue = models, defaults, max_batch, max_queue
        self.budget = budget  # the caches' bytes: jobs are taken while what they may hold fits (None: rows only)
        self.peak_memory = 0  # MLX's peak, read after each step (the metrics' thread does not call into MLX)
        # what warms the kernels and traces up before any request (a text: a few tokens of each decoding path)
        self.warm = warm or (lambda: warm_up(models, models.tokenizer.encode("warm up"), defaults))
        self.ready = False  # warmed up
        self.waiting: list[Job] = []
        self.arrivals = 0  # submissions that could start at once: one that comes ends the step's encoding
        self.encoding_rate = None  # flops a second its encodings of several prompts have run at, lately
        self.lock = threading.Condition()
        self.batches: dict = {}  # drafting kind (or its Express) -> its batch; ("alone", id) -> a batch of one replayed job
        self.jobs: dict[int, Job] = {}  # id(request) -> job, for the rows decoding
        self.joining: list[Joining] = []  # jobs whose prompts are being encoded, a piece a step while rows decode
        self.round_seconds = 0.0  # the last step's rounds, all batches': what a step's encoding may take too
        self.sat_out = 0  # rounds in a row the other batches have sat out while an Express batch's rows decoded
        self.draining = False
        self.metrics = Metrics(name, running=lambda: self.active, waiting=lambda: len(self.waiting), prefix=metrics_prefix,
                               budget=budget, peak=lambda: self.peak_memory)

    def submit(self, jobs: list[Job]) -> None:
        """Queue the jobs (QueueFull: no room in the queue; NeverFits: one could never fit the cache budget)."""
        for job in jobs if self.budget is not None else ():
            needed = self.budget.alone(self.budget.footprint(job.request))
            if needed > self.budget.limit:
                raise NeverFits(needed, self.budget.limit)
        with self.lock:
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull()
            self.waiting += jobs
            if any(self.could_start(job) for job in jobs):
                self.arrivals += 1
            self.lock.notify()

    def could_start(self, job: Job) -> bool:
        """Whether a job that comes now could take a row at the next step: a free row, no encoding of its class under
        way (take_waiting holds it for that), and room in the cache budget. (Read from the event loop's thread: the
        engine's state as it stands, an estimate.)"""
        return self.max_batch - self.active > 0 and self.class_of(job) not in self.encoding_classes() and \
            (self.budget is None or self.budget.fits(self.budget.footprint(job.request)))

    def encoding_classes(self) -> set:
        """The classes of the jobs from the queue being encoded (jobs of these wait for them to end)."""
        return {(joining.kind, joining.size) for joining in list(self.joining) if joining.queued}

    @property
    def active(self) -> int:
        """Rows decoding, and rows being encoded to join them."""
        # Copies: /metrics reads this from the event loop's thread while this one adds and drops batches.
        return sum(len(batch.rows) for batch in list(self.batches.values())) + \
            sum(len(joining.jobs) for joining in list(self.joining))

    @property
    def express_decoding(self) -> bool:
        return any(isinstance(kind, Express) and batch.rows for kind, batch in self.batches.items())

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def record_end(self, job: Job, reason: str) -> None:
        """A job's end, counted once: "stop", "length", "abort" (the client left) or "error"."""
        if not job.counted:
            job.counted = True
            self.metrics.ended(job.times, job.stats, reason)
        if self.budget is not None:
            self.budget.release(id(job))  # its rows' room, free for the queue

    def run(self, stopping: Callable[[], bool]) -> None:
        """Serve until stopping() says so, between rounds; what is left then fails."""
        self.warm()
        self.ready = True
        while not stopping():
            self.step()
        with self.lock:
            encoding = [job for joining in self.joining for job in joining.jobs]
            left, self.waiting = list(self.jobs.values()) + encoding + self.waiting, []
        for job in left:
            job.fail("the server stopped before this request finished")
            self.record_end(job, "error")

    def step(self) -> None:
        """Drop the rows whose jobs ended (their room in the cache budget is free then), admit waiting jobs, encode
        for a while, then a round of each batch (the others sitting out while an Express batch's rows decode, a
        while)."""
        for batch in list(self.batches.values()):
            self.drop_cancelled(batch)
        self.admit()
        arrivals = self.arrivals
        self.encode()
        with self.lock:  # a short request that came while the step encoded: taken and encoded before the rounds
            came = self.arrivals != arrivals and any(map(express, self.waiting))
        if came and any(map(express, self.admit())):
            self.encode(express_only=True)
        holding, held = self.express_decoding and self.sat_out < EXPRESS_ROUNDS_MOST, False  # the others sit it out
        started, decoded = time.perf_counter(), False
        for kind, batch in sorted(self.batches.items(), key=lambda item: not isinstance(item[0], Express)):
            if batch.rows and holding and not isinstance(kind, (Express, tuple)):  # (a job decoded again alone: never)
                held = True
            elif batch.rows:
                self.round(kind, batch)
                decoded = True
            elif isinstance(kind, tuple) and not any(joining.kind == kind for joining in self.joining):
                del self.batches[kind]  # an isolated job's batch, done
        self.sat_out = self.sat_out + 1 if held else 0
        self.round_seconds = time.perf_counter() - started if decoded else 0.0
        self.peak_memory = mx.get_peak_memory()

    def admit(self) -> list[Job]:
        """Waiting jobs take the free rows: the jobs of a drafting kind are encoded together, to join its batch.
        Returns the jobs taken."""
        taken = self.take_waiting()
        now = time.perf_counter()
        for job in taken:
            job.times.admitted = now
            self.metrics.queue_time.observe(now - job.times.arrived)
            self.metrics.prompt_tokens.inc(job.prompt_tokens)
        # A kind's jobs of one size encode together: a short prompt never waits for a long one's encoding, nor a
        # short request for the prompts of long ones.
        together = {}
        for job in taken:
            together.setdefault(self.class_of(job), []).append(job)
        for (kind, _), jobs in together.items():
            self.start_encoding(kind, jobs, queued=True)
        return taken

    def start_encoding(self, kind, jobs: list[Job], queued: bool = False) -> None:
        """The jobs' prompts, encoded together (Joining) to join the kind's batch; `queued`: they came from the queue.
        Its work counts each prompt once (n copies of one are encoded once: Encoding.lengths)."""
        batch = self.batch_of(kind, jobs[0])
        encoding = batch.encoding([job.request for job in jobs])
        encoders = {id(model.encoder): model for model in batch.models}.values()  # (a shared encoder runs once)
        flops = len(encoding.lengths) * sum(encoding_flops(model, max(encoding.lengths)) for model in encoders)
        self.joining.append(Joining(kind, jobs, encoding, queued, flops))

    def batch_of(self, kind, job: Job):
        """The batch of a drafting kind (an isolated job's kind: a batch of one), made if there is none: the
        one there was may have failed since."""
        if kind not in self.batches:
            self.batches[kind] = batch_for(self.models, job.request.settings, 1 if isinstance(kind, tuple) else self.max_batch)
        return self.batches[kind]

    def encode(self, express_only: bool = False) -> None:
        """Encoding takes a step's time in turn with decoding: while rows decode, as long as their rounds took (a piece
        at least), times the rows being encoded over the rows decoding where they are more: a long prompt slows the
        decoding rows down, and does not stop them for its whole encoding, while the rows waiting for their prompts
        (room the batch is not using) get them as soon as their share allows; with no row decoding, ENCODING_SLICE, so
        that the queue is read between. Express joinings go first, with that share whatever else happens; then the
        smaller sizes (size_class), the oldest first within a size, and the oldest of all gets a piece every step
        whatever comes after it; each joins its batch once encoded (at once or in pieces: `encoded`). While express
        rows decode, or with `express_only`, the others get no time (the oldest's piece aside, not with express_only)."""
        for joining in [joining for joining in self.joining if all(job.cancelled for job in joining.jobs)]:
            self.joining.remove(joining)  # every client left while it was encoded
            for job in joining.jobs:
                job.end()
                self.record_end(job, "abort")
        if not self.joining:
            return
        budget = encoding_time(self.round_seconds, sum(len(joining.jobs) for joining in self.joining), len(self.jobs))
        express_budget = budget  # Express joinings keep the step's share, whatever happens to the others'
        if self.express_decoding or express_only:  # its rows end in a few rounds: till then, the oldest's piece
            budget = 0.0
        started, oldest, arrivals, soonest = time.perf_counter(), self.joining[0], self.arrivals, self.soonest_end()
        # Express joinings first, then the smaller sizes (stable: the oldest of a size first)
        for joining in sorted(self.joining, key=lambda joining: (not isinstance(joining.kind, Express), joining.size)):
            express = isinstance(joining.kind, Express)
            if express_only and not express:
                continue
            # A job that came meanwhile (it may be a short prompt, which goes first), or rows that joined an idle
            # engine (they decode now), end the step's encoding: the oldest still gets its piece.
            if self.arrivals != arrivals or (not self.round_seconds and self.jobs):
                budget = 0.0
            left = (express_budget if express else budget) - (time.perf_counter() - started)
            if not express and self.encoding_left(joining) > soonest:  # a row ends first (shortest remaining first)
                left = min(left, 0.0)
            if left <= 0 and joining is not oldest and not express:
                continue
            try:
                if self.encoded(joining, left, lambda: self.arrivals != arrivals):
                    type(joining.jobs[0]).encoded(self.models, joining.encoding.caches[0], joining.jobs)
                    self.batch_of(joining.kind, joining.jobs[0]).join([job.request for job in joining.jobs],
                                                                      joining.encoding)
                    self.jobs.update({id(job.request): job for job in joining.jobs})
                    self.joining.remove(joining)  # after the join: the jobs count as running throughout
                    for job in joining.jobs if self.budget is not None else ():
                        self.budget.encoded(id(job), job.request)
                    soonest = self.soonest_end()  # (a short request's row may have joined)
                    if isinstance(joining.kind, Express):  # its rows decode now: the oldest's piece, at most, first
                        budget = 0.0
            except Exception as e:  # encoding failed: these jobs only
                fatal(e)
                log.exception("encoding failed")
                self.joining.remove(joining)
                for job in joining.jobs:
                    job.fail(f"encoding failed: {e}")
                    self.record_end(job, "error")
        self.metrics.parts["encoding"].inc(time.perf_counter() - started)

    def soonest_end(self) -> float:
        """Seconds until a decoding row can end: its tokens left, at the tokens a round its batch's rows have made,
        times the last step's rounds' time (inf until those and an encoding speed are known)."""
        if not self.encoding_rate or not self.round_seconds:
            return math.inf
        rounds = math.inf
        for batch in self.batches.values():
            per_round = max(1.0, sum(r.produced for r in batch.rows) / max(1, sum(r.stats.target_calls for r in batch.rows)))
            rounds = min([rounds, *(math.ceil((row.settings.max_tokens - row.produced) / per_round) for row in batch.rows)])
        return rounds * self.round_seconds

    def encoding_left(self, joining: Joining) -> float:  # at the last encodings' speed (0 until one is known)
        return max(0.0, joining.flops / self.encoding_rate - joining.encoding.spent) if self.encoding_rate else 0.0

    def encoded(self, joining: Joining, seconds: float, interrupted: Callable[[], bool]) -> bool:
        """Encode for about `seconds`: all at once if none of it has run and the speed of the last encodings says
        it fits (then a job that comes waits for all of it), else in pieces (Encoding.advance); True once done.
        Learns the speed from encodings of several distinct prompts (one alone reads every weight for itself, and
        runs at once anyway: Encoding.small)."""
        encoding = joining.encoding
        if not encoding.spent and self.encoding_rate and joining.flops / self.encoding_rate <= seconds:
            encoding.finish()
        elif not encoding.advance(seconds, interrupted):
            return False
        if len(encoding.lengths) > 1 and encoding.spent > 0.005:
            rate = joining.flops / encoding.spent
            self.encoding_rate = rate if self.encoding_rate is None else 0.7 * self.encoding_rate + 0.3 * rate
        return True

    def take_waiting(self) -> list[Job]:
        """The jobs that get a row now, in the order they came; those whose client left while they waited leave the
        queue (waiting, if there are none, for one to come)."""
        with self.lock:
            if not self.waiting and not self.active:  # (rows being encoded count as active)
                started = time.perf_counter()
                self.lock.wait(timeout=0.1)  # wakes for a job, and for the signals the main thread handles
                self.metrics.parts["idle"].inc(time.perf_counter() - started)
            kept = []
            for job in self.waiting:  # each job's fate read once: the event loop may cancel it meanwhile
                if job.cancelled:
                    job.end()
                    self.record_end(job, "abort")
                else:
                    kept.append(job)
            # A job whose class is being encoded (jobs from the queue; audio files' next windows hold nobody) waits
            # for it to end, to encode with those that came meanwhile: faster together (the weights read once).
            encoding = self.encoding_classes()
            held = [job for job in kept if self.class_of(job) in encoding]
            free, candidates = self.max_batch - self.active, [job for job in kept if job not in held]
            taken, left = self.budget.room_for(candidates, free) if self.budget else (candidates[:free], candidates[free:])
            self.waiting = [job for job in kept if job in held or job in left]
        return taken

    def class_of(self, job: Job) -> tuple:
        """The batch and size of a job (lane, size_class): jobs of a class encode together."""
        return self.lane(job), size_class(len(job.request.source), job.request.settings.max_tokens)

    def lane(self, job: Job):
        """The key of the batch a job joins: its drafting kind (Settings.kind), or that kind's Express batch."""
        kind = job.request.settings.kind(self.models)
        return Express(kind) if express(job) else kind

    def drop_cancelled(self, batch) -> None:
        gone = {row.request for row in batch.rows if self.jobs[id(row.request)].cancelled}
        if gone:
            batch.cancel(gone)
            self.metrics.cancelled.inc(len(gone))
            for request in gone:
                job = self.jobs.pop(id(request))
                job.end()
                self.record_end(job, job.stream.finish_reason or "abort")

    def round(self, kind, batch) -> None:
        """A round of one batch: each event's token to its job's text, and each job that moved publishes once. A round
        that fails leaves its rows' jobs to `isolate`."""
        tokens, touched, started, following = 0, {}, time.perf_counter(), []
        try:
            for request, token, finish in batch.round():
                job = touched[id(request)] = self.jobs[id(request)]
                if job.error is not None:  # its replay went another way: its row leaves at the next round
                    continue
                replaying = bool(job.replay)
                try:  # the job's own work on its token (an audio file's segments, words): a failure is its alone
                    if finish:
                        job.ending(batch, request)
                    accepted = job.accept(token, finish)
                except Exception as e:
                    fatal(e)
                    log.exception("a job's work on its tokens failed")
                    accepted, failure = False, (f"decoding failed: {e}", 400 if isinstance(e, T5Error) else 500)
                else:
                    failure = ("decoding failed, and decoding again decided another token: the answer cannot go on", 500)
                if not accepted:
                    job.cancelled = True
                    job.fail(*failure)
                    self.record_end(job, "error")
                    if finish:  # its row leaves now: so does it
                        self.jobs.pop(id(request), None)
                    continue
                tokens += token is not None and not replaying
                if token is not None and job.times.first_token is None:
                    job.times.first_token = time.perf_counter()
                    self.metrics.first_token.observe(job.times.first_token - job.times.arrived)
                if finish:
                    self.jobs.pop(id(request))
                    following += self.going_on(job, finish)
                elif job.stream.finish_reason:  # a stop string: the row leaves before the next round
                    job.cancelled = True
        except Exception as e:
            fatal(e)
            log.exception("a decoding round failed")
            del self.batches[kind]
            jobs = [self.jobs.pop(id(row.request)) for row in batch.rows if id(row.request) in self.jobs]
            for job in jobs:
                if job.error is not None:  # failed already (its end counted): nothing to decode again
                    continue
                if isinstance(kind, tuple) or len(jobs) == 1:  # decoding alone, it fails: it is the cause
                    job.fail(f"decoding failed: {e}", 400 if isinstance(e, T5Error) else 500)
                    self.record_end(job, "error")
                else:
                    self.isolate(job)
        together = {}  # their next requests encoded together, to join their kind's batch (a temperature may change it)
        for job in following:
            if job.error is None:
                together.setdefault(self.lane(job), []).append(job)
        for next_kind, jobs in together.items():
            self.start_encoding(next_kind, jobs)
        for job in touched.values():
            if job.error is None:
                job.publish()
        self.metrics.parts["decoding"].inc(time.perf_counter() - started)
        self.metrics.generation_tokens.inc(tokens)

    def going_on(self, job: Job, finish: str) -> list[Job]:
        """A job whose request ended: [job] when it goes on with another (an audio file's next window), else [] and its
        end counted. A job whose client left goes no further; one whose next request cannot be made fails alone."""
        try:
            if not job.cancelled and job.follow() is not None:
                return [job]
        except Exception as e:
            fatal(e)
            log.exception("a job's next request failed")
            job.fail(f"decoding failed: {e}", 400 if isinstance(e, T5Error) else 500)
            self.record_end(job, "error")
            return []
        if job.stream.finish_reason is None and job.cancelled:  # its client left mid-way: nobody waits for the rest
            job.end()
        self.record_end(job, job.stream.finish_reason or ("abort" if job.cancelled else finish))
        return []

    def isolate(self, job: Job) -> None:
        """A job whose batch failed decodes again from its start in a batch of its own, on its own random stream, its
        text's tokens decided again (and checked) before any new one goes out: if it fails alone, it was the cause; the
        others go on as they would have."""
        job.request = job.again()
        if self.budget is not None:
            self.budget.encoding.add(id(job))  # encoded again: its working memory counts again until it joins
        self.start_encoding(("alone", id(job.request)), [job])
