"""How the server's engine schedules encoding under load (serving/engine.py): jobs of one class encode together and a
short request apart, first; a job whose class is being encoded waits to go with the next ones rather than be encoded
alone, but not behind an audio file's next window; a job that comes ends the step's encoding after the piece in hand;
a short request decodes in a batch of its own whose rounds go first, within a bound."""

import dataclasses
from pathlib import Path

import pytest

import main
from generate import generate
from loading import load
from options import Settings
from rows import Encoding, Request
from serving.engine import (ENCODING_SHARE_MOST, ENCODING_SLICE, EXPRESS_ROUNDS_MOST, EXPRESS_TOKENS, Engine, Express,
                            Joining, encoding_time, size_class)
from serving.jobs import Job
from text import TextStream

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models():
    return load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")


def job(tokens: int, max_tokens: int) -> Job:
    return Job(Request(list(range(5, 5 + tokens)), Settings(max_tokens=max_tokens, speculative=False)), None, None, None)


def test_jobs_of_a_class_encode_together_and_a_short_request_apart_and_first(models):
    """Eight requests of 500 tokens and one of 5, queued together: two encodings, the short one's first."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    longs, short = [job(50, 500) for _ in range(8)], job(50, 5)
    engine.submit([*longs[:4], short, *longs[4:]])
    engine.admit()
    assert sorted([len(joining.jobs) for joining in engine.joining]) == [1, 8]
    while engine.joining:
        engine.encode()
    assert list(engine.jobs.values()) == [short, *longs]  # (in the order they joined their batch)
    assert size_class(50, 5) < size_class(50, 500) < size_class(2000, 5)  # a long prompt's class comes last


def test_a_job_whose_class_is_being_encoded_waits_for_that_encoding_to_end(models):
    """Jobs that come while prompts of their class are encoded wait, then encode together; a job of another class
    is taken at once."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    engine.submit([job(50, 100) for _ in range(3)])
    engine.admit()
    (encoding,) = engine.joining
    later, other = [job(60, 100), job(40, 100)], job(50, 5)
    engine.submit([*later, other])
    engine.admit()
    assert engine.waiting == later and [joining.jobs for joining in engine.joining] == [encoding.jobs, [other]]
    while engine.joining:
        engine.encode()  # (both encodings join their batch: no round runs here)
    engine.admit()
    assert engine.waiting == [] and [joining.jobs for joining in engine.joining] == [later]


def test_an_audio_files_next_window_being_encoded_holds_no_job(models):
    """Only encodings of jobs from the queue hold the queue's jobs of their class: the next windows of files being
    transcribed follow one another, and a new file waiting behind them would wait for every file to end."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    following = job(50, 100)
    kind = following.request.settings.kind(models)
    engine.joining.append(Joining(kind, [following], engine.batch_of(kind, following).encoding([following.request])))
    new = job(50, 100)
    engine.submit([new])
    engine.admit()
    assert engine.waiting == [] and [joining.jobs for joining in engine.joining] == [[following], [new]]


def test_a_job_that_comes_ends_the_steps_encoding_after_the_piece_in_hand(models):
    """advance stops after one piece when interrupted (a job came), however long it was given; else it goes on."""
    sources = [list(range(5, 60)), list(range(5, 50))]  # two prompts: in pieces, never all at once
    interrupted, whole = Encoding([models.target], sources), Encoding([models.target], sources)
    assert not interrupted.small
    assert not interrupted.advance(60.0, lambda: True)
    assert whole.advance(60.0)
    while not interrupted.advance(0.0):
        pass
    assert [a.tolist() for a in interrupted.caches[0].cross_keys_values[0]] == \
        [a.tolist() for a in whole.caches[0].cross_keys_values[0]]


def test_only_a_job_that_could_start_now_ends_the_steps_encoding(models):
    """A job counts as an arrival (which ends the step's encoding) when it could take a row at the next step: not
    when its class is being encoded (it waits for that), nor when no row is free."""
    engine = Engine(models, Settings(), max_batch=4, max_queue=64)
    engine.submit([job(50, 100) for _ in range(2)])
    assert engine.arrivals == 1
    engine.admit()  # their class is being encoded now
    engine.submit([job(50, 100)])
    assert engine.arrivals == 1
    engine.submit([job(50, 5)])  # another class, and rows are free
    assert engine.arrivals == 2
    engine.admit()  # three rows taken: two being encoded and the short one; the held job waits, a row is free
    engine.submit([job(50, 5000)])
    assert engine.active == 3 and engine.arrivals == 3
    engine.admit()
    engine.submit([job(50, 5)])  # no row is free
    assert engine.active == 4 and engine.arrivals == 3


def test_an_encoding_the_last_ones_speed_says_fits_runs_at_once_and_the_speed_is_learnt(models):
    """With no speed known, several prompts encode a piece at a time; an encoding whose work at the learnt speed
    fits the time given runs whole in one call, and one that would not goes in pieces; the caches are the same."""
    def joining(engine, max_tokens):  # (a class of its own each: jobs of a class being encoded wait for it)
        engine.submit([job(50, max_tokens), job(40, max_tokens), job(30, max_tokens)])
        engine.admit()
        return engine.joining[-1]

    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    first = joining(engine, 100)
    assert not engine.encoded(first, 0.0, lambda: False)  # one piece
    while not engine.encoded(first, 0.0, lambda: False):
        pass
    assert engine.encoding_rate == pytest.approx(first.flops / first.encoding.spent)
    fast = joining(engine, 1000)
    engine.encoding_rate = fast.flops / 1e-5  # ten microseconds' work
    assert engine.encoded(fast, 1e-4, lambda: False)
    slow = joining(engine, 5000)
    engine.encoding_rate = slow.flops / 1e-3
    assert not engine.encoded(slow, 1e-4, lambda: False)
    assert [a.tolist() for a in fast.encoding.caches[0].cross_keys_values[-1]] == \
        [a.tolist() for a in first.encoding.caches[0].cross_keys_values[-1]]


def test_an_encodings_work_counts_a_prompt_sent_several_times_once(models):
    """n copies of a prompt are encoded once (Encoding): their work is one prompt's, and the engine learns no speed
    from them (it would take them for n prompts encoded in the time of one)."""
    from generate import encoding_flops

    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    copies = [job(50, 100) for _ in range(4)]
    engine.submit(copies)
    engine.admit()
    (joining,) = engine.joining
    assert joining.flops == encoding_flops(models.target, 50)
    while not engine.encoded(joining, 0.0, lambda: False):
        pass
    assert engine.encoding_rate is None


def test_a_steps_encoding_takes_the_rounds_time_row_for_row_within_a_bound():
    """Rows waiting for their prompts get as long as the rounds took, times their count over the rows decoding where
    that is more, up to ENCODING_SHARE_MOST times; with no row decoding, a slice."""
    assert encoding_time(0.2, 2, 8) == 0.2
    assert encoding_time(0.2, 16, 8) == pytest.approx(0.4)
    assert encoding_time(0.2, 60, 1) == pytest.approx(0.2 * ENCODING_SHARE_MOST)
    assert encoding_time(0.0, 60, 0) == ENCODING_SLICE


def with_steps_seconds(engine: Engine) -> list:
    """The seconds each encoding is given (Engine.encoded's), in order, as the engine runs."""
    given, encoded = [], engine.encoded
    engine.encoded = lambda joining, seconds, interrupted: given.append((joining, seconds)) or encoded(joining, seconds,
                                                                                                       interrupted)
    return given


@pytest.mark.parametrize("left_seconds, held", [(100.0, True), (1.0, False)])
def test_an_encoding_a_row_would_wait_for_gets_one_piece_a_step(models, left_seconds, held):
    """A request of 17 tokens (one more than an express one's) decoding while eight long ones' prompts are encoded:
    when its tokens (17 rounds of 1 s at most) end before what that encoding has left (100 s at the learnt speed), the
    encoding gets no time, so one piece (shortest remaining first); when they would not (1 s left), its share: 8
    rounds' time, all it needs here."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    longs, short = [job(50 + i, 500) for i in range(8)], job(50, EXPRESS_TOKENS + 1)
    engine.submit([*longs, short])
    engine.admit()
    engine.encode()  # the short prompt, at once: it decodes now; the long ones' encoding has had a piece
    (encoding,) = engine.joining
    assert list(engine.jobs.values()) == [short] and encoding.jobs == longs and not encoding.encoding.caches
    engine.round_seconds, engine.encoding_rate = 1.0, encoding.flops / left_seconds
    assert engine.soonest_end() == 17.0 and (engine.encoding_left(encoding) > 17.0) == held
    given = with_steps_seconds(engine)
    engine.encode()
    assert [joining for joining, _ in given] == [encoding] and (given[0][1] <= 0) == held
    assert (engine.joining == [encoding]) == held


def test_a_short_prompt_is_not_held_back_with_a_long_encoding_a_row_waits_for(models):
    """What a row that ends soon (20 tokens: past an express request's) holds back is an encoding with more left
    than the row's time (1,000 s against 200), not a short prompt that came meanwhile (about 100 s): that one is
    encoded at once and joins, and the long one, the oldest, gets its piece."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    longs, short = [job(50 + i, 500) for i in range(8)], job(50, 20)
    engine.submit([*longs, short])
    engine.admit()
    engine.encode()
    (encoding,) = engine.joining
    engine.round_seconds, engine.encoding_rate = 10.0, encoding.flops / 1000.0
    later = job(40, 20)
    engine.submit([later])
    engine.admit()
    assert engine.encoding_left(engine.joining[-1]) < engine.soonest_end() == 200.0 < engine.encoding_left(encoding)
    given = with_steps_seconds(engine)
    engine.encode()
    assert [joining.jobs for joining, _ in given] == [[later], longs] and given[0][1] > 0 >= given[1][1]
    assert list(engine.jobs.values()) == [short, later] and engine.joining == [encoding]


class Inline:
    """A job's event loop and queue, here: what it sends is kept at once."""

    def __init__(self):
        self.sent = []

    def call_soon_threadsafe(self, send, *args):
        send(*args)

    def put_nowait(self, item):
        self.sent.append(item)

    @property
    def text(self) -> str:
        return "".join(item[0] for item in self.sent if item)


def streamed(models, prompt: str, settings: Settings) -> Job:
    inline = Inline()
    return Job(Request(models.tokenizer.encode(prompt), settings), TextStream(models.tokenizer), inline, inline)


@pytest.mark.parametrize("speculative", [False, True])
def test_a_short_request_decodes_in_a_batch_of_its_own_whose_rounds_go_first_within_a_bound(models, speculative):
    """A request of EXPRESS_TOKENS tokens sent while two long ones decode: it joins its kind's Express batch, apart
    from them, at the next step; while its row decodes, its rounds go first and the long ones' batch sits out
    EXPRESS_ROUNDS_MOST rounds in a row, then takes one; every answer is what `generate` gives it alone."""
    settings = Settings(max_tokens=80, ignore_eos=True, speculative=speculative, num_draft=3, delta=0)
    engine = Engine(models, settings, max_batch=8, max_queue=8)
    prompts = main.demo_prompts()[:3]
    longs = [streamed(models, prompt, settings) for prompt in prompts[:2]]
    engine.submit(longs)
    while len(engine.jobs) < 2:
        engine.step()
    engine.step()
    short = streamed(models, prompts[2], dataclasses.replace(settings, max_tokens=EXPRESS_TOKENS))
    engine.submit([short])
    rounds, ran = [], engine.round
    engine.round = lambda kind, batch: rounds.append(isinstance(kind, Express)) or ran(kind, batch)
    steps = []
    while short.stream.finish_reason is None:
        before = len(rounds)
        engine.step()
        steps.append(rounds[before:])
    kind = settings.kind(models)
    assert set(engine.batches) == {kind, Express(kind)}
    pattern = ([[True]] * EXPRESS_ROUNDS_MOST + [[True, False]]) * len(steps)
    assert steps == pattern[:len(steps)] and len(steps) > EXPRESS_ROUNDS_MOST + 1, steps
    while engine.busy:
        engine.step()
    for job, prompt in zip([*longs, short], prompts):
        assert job.out.text == generate(models, prompt, settings=job.request.settings), prompt


def test_a_short_request_that_joins_ends_the_steps_encoding(models):
    """With no encoding speed known yet (a fresh server), eight long prompts would have the step's whole share (8
    rounds' time); once a short request's row has joined (its rounds go first), the rest of the step gives them one
    piece, the oldest's."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    longs, short = [job(50 + i, 500) for i in range(8)], job(50, 5)
    engine.submit([*longs, short])
    engine.admit()
    engine.round_seconds = 1.0
    given = with_steps_seconds(engine)
    engine.encode()
    assert [joining.jobs for joining, _ in given] == [[short], longs] and given[0][1] > 7.0 and given[1][1] <= 0
    assert list(engine.jobs.values()) == [short] and [joining.jobs for joining in engine.joining] == [longs]


def test_while_a_short_requests_row_decodes_encoding_gives_the_oldest_its_piece_and_short_prompts_theirs(models):
    """An express row ends in a few rounds: till then long prompts get no time of the step (the oldest's piece), and
    a short request that came gets the step's share, to decode beside it."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    short = job(50, 5)
    engine.submit([short])
    engine.admit()
    engine.encode()
    longs, later = [job(50 + i, 500) for i in range(8)], job(40, 5)
    engine.submit(longs)
    engine.admit()
    engine.submit([later])
    engine.admit()
    engine.round_seconds = 1.0  # (8 rounds' time for the long prompts, but for the express row)
    assert engine.express_decoding
    given = with_steps_seconds(engine)
    engine.encode()
    assert [joining.jobs for joining, _ in given] == [[later], longs] and given[0][1] > 7.0 and given[1][1] <= 0
    assert list(engine.jobs.values()) == [short, later] and [joining.jobs for joining in engine.joining] == [longs]


def test_a_short_request_that_comes_while_the_step_encodes_decodes_in_that_steps_rounds(models):
    """A short request sent while a step encodes a long prompt is taken, encoded and given its first round in that
    step, not after the step's rounds."""
    settings = Settings(max_tokens=80, ignore_eos=True, speculative=False)
    engine = Engine(models, settings, max_batch=8, max_queue=8)
    prompts = main.demo_prompts()[:3]
    engine.submit([streamed(models, prompts[0], settings)])
    engine.step()
    short = streamed(models, prompts[2], dataclasses.replace(settings, max_tokens=5))
    encode, sent = engine.encode, []

    def encoding(express_only=False):  # the short request comes while the long one is encoded
        encode(express_only)
        if not sent:
            sent.append(engine.submit([short]))

    engine.encode = encoding
    engine.submit([streamed(models, prompts[1], settings)])
    engine.step()
    assert sent and len(short.stream.tokens) >= 1


def test_a_short_request_on_a_long_prompt_gets_the_steps_share_while_express_rows_decode(models):
    """A label asked of a long document (600 tokens: encoded in pieces) is an express request too: while another's
    row decodes, it gets the step's share (and is encoded in it), not one piece a step."""
    engine = Engine(models, Settings(), max_batch=64, max_queue=64)
    engine.submit([job(50, 5)])
    engine.admit()
    engine.encode()
    document = job(600, 5)
    engine.submit([document])
    engine.admit()
    assert not engine.joining[0].encoding.small and engine.express_decoding
    engine.round_seconds = 1.0
    given = with_steps_seconds(engine)
    engine.encode()
    assert given[0][1] > 0.5 and id(document.request) in engine.jobs


def test_a_step_takes_the_queue_again_only_for_a_short_request_that_came_and_can_start(models):
    """The second admission before the rounds is for a short request that came while the step encoded and can take
    a row: one that waits for a free row does not make every step admit and encode twice."""
    settings = Settings(max_tokens=80, ignore_eos=True, speculative=False)
    engine = Engine(models, settings, max_batch=1, max_queue=8)
    engine.submit([streamed(models, main.demo_prompts()[0], settings)])
    engine.step()
    engine.submit([streamed(models, main.demo_prompts()[1], dataclasses.replace(settings, max_tokens=5))])
    admitted, admit = [], engine.admit
    engine.admit = lambda: admitted.append(1) or admit()
    for _ in range(3):
        engine.step()
    assert len(admitted) == 3 and len(engine.waiting) == 1
