"""Long prompts: announced before a long wait, timed apart from decoding, bounded in memory, and never encoded
more than needed."""

import json
import re
import subprocess
import sys

import pytest

import decoder
import rows
import generate
import main
from conftest import ROOT
from loading import load_model, load_tokenizer
from model import EncoderDecoder
from options import Settings


@pytest.fixture(scope="module")
def long_prompt():
    """The held-out demo prompts in one: about a thousand tokens."""
    prompt = " ".join(main.demo_prompts())
    assert len(load_tokenizer(main.DEMO_DIR / "target").encode(prompt)) > generate.TRAINED_LENGTH
    return prompt


class EngineClock:
    """One of the engine's clocks, in the tests' hands: `tick` passes at each
    reading (a millisecond), and what `advance` adds."""

    def __init__(self, tick: float = 0.001):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def slow_encoding(monkeypatch):
    """Encoding a prompt of more than 512 tokens takes each model 1.5 s longer
    on the engine's clock, as on a slow machine (nothing sleeps); the list of
    such encodings (their lengths, one per model) comes back."""
    encoded, real, clock = [], EncoderDecoder.encoding, EngineClock()

    def slow(self, source, *args):  # a model's encoding, run in the batch's timing of it
        if source.shape[1] > generate.TRAINED_LENGTH:
            encoded.append(source.shape[1])
            clock.advance(1.5)
        return (yield from real(self, source, *args))

    monkeypatch.setattr(EncoderDecoder, "encoding", slow)
    monkeypatch.setattr(rows.Batch, "clocks", (clock, lambda: 0.0))  # and MLX compiles nothing
    return encoded


def test_the_statistics_give_the_prompts_length_and_a_long_prompt_is_warned_of(long_prompt, capsys, recwarn):
    assert main.main(["--demo", "--regular-decode", "--max-tokens", "3", "--prompt", long_prompt]) == 0
    tokens = len(load_tokenizer(main.DEMO_DIR / "target").encode(long_prompt))
    assert re.search(rf"prompt {tokens:,} tokens encoded in \d+\.\d\d s", capsys.readouterr().out)
    assert any(f"the prompt has {tokens:,} tokens, more than the 512 T5 was trained on" in str(w.message) for w in recwarn)


@pytest.mark.parametrize("as_json", [False, True])
def test_a_prompt_that_will_take_a_while_to_encode_is_announced(capsys, monkeypatch, as_json):
    monkeypatch.setattr(generate, "assumed_encoding_rate", lambda: 1e6)  # a very slow machine
    assert main.main(["--demo", "--regular-decode", "--max-tokens", "2"] + ["--json"] * as_json) == 0
    assert re.search(r"Encoding a \d+-token prompt: about \d+ s \.\.\.", capsys.readouterr().err)


def test_tokens_per_second_is_decoding_speed_and_encoding_is_timed_apart(long_prompt, slow_encoding, capsys):
    """A 5-token answer to a prompt whose encoding takes 1.5 s: the statistics
    charge those seconds to encoding, none of them to decoding, whose seconds
    alone tokens/s counts."""
    result = main.main(["--demo", "--regular-decode", "--max-tokens", "5", "--prompt", long_prompt, "--json"])
    assert result == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["encoding_seconds"] == pytest.approx(1.5, abs=0.01)  # and a reading's millisecond
    assert stats["decoding_seconds"] == pytest.approx(stats["seconds"] - stats["encoding_seconds"])
    assert 0 < stats["decoding_seconds"] < 0.1  # a few readings: no second of the encoding's
    assert stats["tokens_per_second"] == pytest.approx(5 / stats["decoding_seconds"])


def test_seconds_mlx_spends_compiling_kernels_count_as_neither_encoding_nor_decoding(monkeypatch):
    """MLX compiling kernels for 2 s while a prompt encodes and 3 s in its
    first decoding step (a first run on a machine): those 5 s are the
    statistics' compiling_seconds, and tokens/s counts decoding alone."""
    from dataclasses import replace

    from generate import batch_generate
    from loading import load

    clock, compiling = EngineClock(), EngineClock(tick=0.0)
    real_encode, real_step = EncoderDecoder.encoding, decoder.RegularBatch.step

    def compiles(seconds):
        clock.advance(seconds)
        compiling.advance(seconds)

    def encode(self, source, *args):
        compiles(2.0)
        return (yield from real_encode(self, source, *args))

    def step(self, *args, **kwargs):
        if not getattr(self, "compiled", False):
            self.compiled = True
            compiles(3.0)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(EncoderDecoder, "encoding", encode)
    monkeypatch.setattr(decoder.RegularBatch, "step", step)
    monkeypatch.setattr(rows.Batch, "clocks", (clock, compiling))
    models = load(main.DEMO_DIR / "target")
    (generation,) = batch_generate(models, ["import <extra_id_0>"], max_tokens=5, speculative=False)
    stats = generation.stats
    assert stats.compiling_seconds == 5.0
    assert 0 < stats.encoding_seconds < 0.05 and 0 < stats.decoding_seconds < 0.1
    assert stats.tokens_per_second == pytest.approx(stats.generated / stats.decoding_seconds)
    assert stats.seconds == pytest.approx(stats.encoding_seconds + stats.compiling_seconds + stats.decoding_seconds)
    assert replace(stats, compiling_seconds=0).decoding_seconds > 5.0


def test_the_demo_does_not_encode_a_long_prompt_again_for_its_speedup_line(long_prompt, slow_encoding, capsys,
                                                                            monkeypatch):
    """The answer encodes the prompt once per model; the warm-up takes a
    short piece of it (the encoding is known to be slow), and the speedup
    line, whose runs would each encode it again, is left out with the reason
    (once, it ran for half an hour)."""
    monkeypatch.setattr(generate, "assumed_encoding_rate", lambda: 1e8)  # as slow as slow_encoding makes it
    assert main.main(["--demo", "--max-tokens", "5", "--prompt", long_prompt]) == 0
    out = capsys.readouterr().out
    assert len(slow_encoding) == 2, slow_encoding  # the target's and the draft's, for the answer
    assert "Speedup not measured: a run of each mode would take about" in out and "--compare" in out


def test_the_demos_speedup_takes_fewer_runs_when_they_cost_more(capsys, monkeypatch):
    """A run of each mode costing 2 s: two runs of each fit the 5 s the line may take, and it says so."""
    from options import Stats
    from display import show_speedup
    from loading import load

    models = load(main.DEMO_DIR / "target", draft=main.DEMO_DIR / "draft")
    runs = []
    monkeypatch.setattr("display.measure", lambda *args: runs.append(1) or Stats(generated=10, seconds=1.0))
    show_speedup(models, "x", Settings(), answer=Stats(generated=10, seconds=1.0))
    assert len(runs) == 4 and "medians of 2 runs each: a run of each takes about 2.0 s" in capsys.readouterr().out


def test_the_encoding_estimate_grows_with_the_square_of_the_length():
    """Doubling the length doubles the products' work and quadruples
    attention's, so the excess over twice the work is attention's: two
    products of L x L x inner per encoder layer, 2 flops a multiply-add."""
    target = load_model(main.DEMO_DIR / "target")
    a = target.args
    for length in (512, 8192):
        excess = generate.encoding_flops(target, 2 * length) - 2 * generate.encoding_flops(target, length)
        assert excess == 2 * (a.num_layers * 2 * 2 * length * length * a.num_heads * a.d_kv)


MEMORY_PROBE = r"""
import re, resource, sys
from pathlib import Path
from rows import encode_for  # before mlx.core, through cpu.py: the fast BLAS
from loading import load_model

def peak():  # bytes. Linux's ru_maxrss counts the parent's memory from before the exec: VmHWM does not
    if sys.platform == "darwin":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024

model = load_model("demo/target")
# Two of its six encoder layers: a layer's attention is the peak, and the layers run one after another (the second
# shows what one layer leaves to the next); all six took 3x as long to the same peak, within 40 MB.
model.encoder.layers = model.encoder.layers[:2]
encode_for([model], [list(range(3, 67))])  # warm-up: buffers, kernels
before = peak()
encode_for([model], [[(i * 7919) % 1000 + 3 for i in range(8191)] + [1]])
print(before, peak())
"""


def test_a_long_prompt_encodes_in_less_memory_than_one_full_score_matrix():
    """The demo target (its first two encoder layers) given 8,192 tokens: a
    full (heads, L, L) float32 score matrix alone would take 1.07 GB; encoding
    in blocks must grow the process's peak resident memory by less than that,
    and the whole process must stay under 1.5 GB (measured in a fresh process)."""
    heads, length = 4, 8192
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    before, after = map(int, done.stdout.split()[-2:])
    assert after - before < heads * length * length * 4, f"peak grew by {(after - before) / 1e6:.0f} MB"
    assert after < 1.5e9, f"peak {after / 1e9:.2f} GB"


def test_rows_encoded_together_each_count_the_whole_encoding_as_theirs(long_prompt, slow_encoding):
    """A short prompt joining a batch with a long one waits for both to be
    encoded: its decoding speed must not count that wait (it once counted
    all but its share by tokens, and read 2 tokens/s)."""
    from generate import batch_generate
    from loading import load

    models = load(main.DEMO_DIR / "target", draft=main.DEMO_DIR / "draft")
    long, short = (g.stats for g in batch_generate(models, [long_prompt, "import <extra_id_0>"], batch_size=2, max_tokens=5))
    assert long.encoding_seconds == short.encoding_seconds == pytest.approx(3.0, abs=0.01)  # each model's 1.5 s
    assert 0 < long.decoding_seconds < 0.1 and 0 < short.decoding_seconds < 0.1  # a few readings of the clock


def test_a_prompt_encoded_a_piece_at_a_time_gives_the_caches_encoding_at_once_gives(demo_models):
    """Both models' caches for prompts of 1,500 and 40 tokens and the long one
    again, encoded a piece at a time (each piece a part of a layer, so that
    decoding can run between them): bit for bit those of encoding at once.
    Work of one chunk or less is done at once."""
    import mlx.core as mx

    long, short = [3 + (i * 7919) % 2000 for i in range(1499)] + [1], list(range(3, 42)) + [1]
    models = [demo_models.target, demo_models.draft]
    whole = rows.encode_for(models, [long, short, long])
    encoding, pieces = rows.Encoding(models, [long, short, long]), 0
    while not encoding.advance(0.0):  # a piece each time
        pieces += 1
    layers = sum(model.args.num_layers for model in models)
    assert pieces > 2 * layers  # every layer in several pieces
    for at_once, in_pieces in zip(whole, encoding.caches):
        assert mx.array_equal(at_once.cross_bias, in_pieces.cross_bias)
        for a, b in zip(at_once.cross_keys_values, in_pieces.cross_keys_values):
            assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    small = rows.Encoding(models, [short])
    assert small.advance(0.0) and small.caches is not None


def test_a_row_encoded_in_pieces_counts_the_wait_between_them_as_encoding_not_decoding(demo_models, monkeypatch):
    """Other rows' rounds between a long prompt's pieces (half a second
    each on the batch's clock) are time its row waited to be encoded:
    encoding's in its statistics, none of it decoding's."""
    from batches import batch_for

    clock = EngineClock()
    monkeypatch.setattr(rows.Batch, "clocks", (clock, lambda: 0.0))
    settings = Settings(max_tokens=3, speculative=False)
    batch = batch_for(demo_models, settings, 1)
    request = rows.Request([3 + (i * 7919) % 2000 for i in range(1499)] + [1], settings)
    encoding, pieces = batch.encoding([request]), 1
    while not encoding.advance(0.0):
        clock.advance(0.5)
        pieces += 1
    batch.join([request], encoding)
    while batch.rows:
        list(batch.round())
    stats = request.stats
    assert pieces > 10 and stats.encoding_seconds == pytest.approx(0.5 * (pieces - 1), abs=0.1)
    assert 0 < stats.decoding_seconds < 0.05  # a few of the clock's millisecond readings
