"""The text API: prompts in, text out, streamed or in batches, over the decoding engine (decoder.py).

    models = loading.load("mlx_models/t5-11b", draft="mlx_models/t5-small")
    text = generate(models, "translate English to German: Good morning.", num_draft=5)
    for response in stream_generate(models, prompt):
        print(response.text, end="", flush=True)

    generations = batch_generate(models, prompts, batch_size=8)   # many prompts, decoded together
    texts = [g.text for g in generations]

Options are decoder.Settings' knobs, checked at the call. Drafts come from the
draft model, num_draft at a time or as many as AutoDraft finds worth it
(num_draft="auto"), or from the prompt (prompt_lookup=True, no draft model).
"""

import time
import warnings
from dataclasses import astuple, dataclass, replace
from typing import Iterator

import cpu  # before mlx.core

from decoder import (AUTO, Batch, Knob, OptionError, RegularBatch, Settings, SpeculativeBatch, Stats, drive,
                     numbered)
from drafting import AutoDraft, DraftModel, LookupDrafter
from loading import Models
from model import T5

TRAINED_LENGTH = 512  # T5's pre-training inputs; longer ones work, less well


def assumed_encoding_rate() -> float:
    """Encoding speed (flops/s) assumed until a long prompt measures it: on
    the CPU path the slow end of what 2 x86 cores did on T5-large and the
    demo target (30-140 G, by machine and length: bench.py encode), so that
    a wait is announced, not missed."""
    return 30e9 if cpu.in_use() else 1e12


def encoding_flops(model: T5, tokens: int) -> float:
    """The work of encoding a prompt: its products (2 flops per weight and
    token, cross-attention keys and values included) and attention (its two
    products, 4 flops per query, key and inner dimension), which grows with
    the square of the length."""
    a = model.args
    inner = a.num_heads * a.d_kv
    ffn = (3 if a.feed_forward_proj.startswith("gated") else 2) * a.d_model * a.d_ff
    per_token = 2 * a.num_layers * (4 * a.d_model * inner + ffn) + 2 * a.num_decoder_layers * 2 * a.d_model * inner
    return tokens * per_token + 4 * a.num_layers * tokens * tokens * inner


def encoders(models: Models, settings: "Settings") -> list[T5]:
    """The models that encode each prompt: the target, and the draft model when it drafts."""
    return [models.target] + ([models.draft] if settings.drafts(models) and not settings.prompt_lookup else [])


def encoding_seconds(models: Models, tokens: int, settings: "Settings") -> float:
    """A rough estimate of a prompt's encoding, from the speed the pair's
    earlier prompts were encoded at."""
    flops = sum(encoding_flops(model, tokens) for model in encoders(models, settings))
    return flops / (models.encoding_rate or assumed_encoding_rate())


def learn_encoding_rate(models: Models, settings: "Settings", stats: Stats) -> None:
    """Keep the speed a prompt was encoded at, when it took long enough to tell."""
    if stats.encoding_seconds > 0.5:
        flops = sum(encoding_flops(model, stats.prompt_tokens) for model in encoders(models, settings))
        models.encoding_rate = flops / stats.encoding_seconds


class Detokenizer:
    """Text from token ids as they come, equal to decoding them all at once.

    Each token decodes a short window: the tokens since the last piece of
    text was settled, twice (with and without the new ones). The difference
    is the new text, held back while it ends in an incomplete character. The
    window restarts after every emitted piece, so the work per token follows
    the new piece, not the length of the output. Decoding never "cleans up"
    spaces before punctuation (an old transformers default, off since v5):
    that would take back a space already shown."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens = []
        self.start = 0  # first token of the window
        self.settled = 0  # tokens already turned into emitted text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """The text this token adds; "" while it is held back."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.start : self.settled])
        after = self.decode(self.tokens[self.start :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.start, self.settled = self.settled, len(self.tokens)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as \ufffd)."""
        before = self.decode(self.tokens[self.start : self.settled])
        after = self.decode(self.tokens[self.start :])
        self.start = self.settled = len(self.tokens)
        return after[len(before) :]


@dataclass
class Response:
    """One step of `stream_generate`: the new piece of text, the token that
    made it, and the statistics so far. The last response has token None,
    carries any text held back until the end, and says why generation
    stopped: finish_reason "eos" or "length"."""

    text: str
    token: int | None
    stats: Stats
    finish_reason: str | None = None


BATCH_SIZE = Knob("batch_size", int, lambda v: v >= 1, "an integer >= 1", "prompts decoded together")


def check_prompts(prompts: list[str]) -> None:
    """TypeError unless prompts is a list (or tuple) of strings; OptionError if it is empty."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings (got one string: generate takes one prompt)")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of strings (got {type(prompts).__name__})")
    if not prompts:
        raise OptionError("prompts must be a non-empty list of strings (got an empty one)")
    for number, prompt in enumerate(prompts, 1):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts must be a list of strings (prompt {number} is {type(prompt).__name__})")


def check_prompt(prompt: str) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt must be a string (got {type(prompt).__name__})")


def tokenize(models: Models, prompts: list[str]) -> list[list[int]]:
    """Each prompt's ids. OptionError for an empty prompt; a warning for
    prompts longer than T5 was trained on."""
    check_prompts(prompts)
    for number, prompt in enumerate(prompts, 1):
        if not prompt.strip():
            raise OptionError("the prompt is empty" if len(prompts) == 1 else f"prompt {number} of {len(prompts)} is empty")
    ids = [models.tokenizer.encode(prompt) for prompt in prompts]
    longest = max(len(i) for i in ids)
    if longest > TRAINED_LENGTH:
        which = "the prompt has" if len(ids) == 1 else f"{sum(len(i) > TRAINED_LENGTH for i in ids)} prompt(s) have up to"
        warnings.warn(f"{which} {longest:,} tokens, more than the {TRAINED_LENGTH} T5 was trained on: "
                      "the output may suffer", RuntimeWarning, stacklevel=4)
    return ids


def batch_for(models: Models, settings: Settings, batch_size: int) -> Batch:
    """The batch that decodes at these settings: speculative when
    settings.drafts(models) (with prompt lookup's drafts, or the draft
    model's), else the target alone. With num_draft "auto", the AutoDraft
    keeps what the pair has shown so far at these settings (Models.drafting)."""
    if not settings.drafts(models):
        return RegularBatch(models.target, batch_size)
    if settings.prompt_lookup:
        drafter = LookupDrafter(models.target.args.vocab_size)
    elif settings.num_draft == AUTO:
        drafter = DraftModel(models.draft, models.drafting.setdefault(
            (settings.delta, astuple(settings.sampling), batch_size), AutoDraft()))
    else:
        drafter = DraftModel(models.draft)
    return SpeculativeBatch(models.target, drafter, batch_size)


def decode_batch(models: Models, ids: list[list[int]], settings: Settings, stats: list[Stats],
                 batch_size: int) -> Iterator[tuple[int, int | None, bool]]:
    """(prompt index, token, finished) as rows decide them; each prompt with
    its own random stream from the seed (or, without one, from MLX's generator)."""
    requests = [settings.request(prompt, row_stats) for prompt, row_stats in zip(ids, stats)]
    yield from numbered(requests, drive(batch_for(models, settings, batch_size), requests))


def generate_tokens(models: Models, prompt: str, settings: Settings, stats: Stats) -> Iterator[int]:
    """One prompt's token ids as they are decided; the prompt is checked now."""
    check_prompt(prompt)
    ids = tokenize(models, [prompt])
    return (token for _, token, _ in decode_batch(models, ids, settings, [stats], 1) if token is not None)


def stream_generate(models: Models, prompt: str, **options) -> Iterator[Response]:
    """Yield a Response as each token is decided. Options, all keywords:
    max_tokens=100, num_draft=5 (or "auto": see AutoDraft), delta=0.0,
    temp=0.0, top_k=0, top_p=1.0, seed=None (the same seed, the same draws
    for the same prompt; None: drawn from MLX's generator), speculative=True (False: the target alone, even with a
    draft), prompt_lookup=False (True: drafts copied from the prompt and the
    output, see PromptLookup; a draft model, if loaded, is not used).
    Options and the prompt are checked at the call, before any decoding:
    OptionError names one out of range."""
    settings = Settings.of(options).check_models(models)
    stats = Stats()
    tokens = generate_tokens(models, prompt, settings, stats)
    detokenizer = Detokenizer(models.tokenizer)

    def responses():
        for token in tokens:
            yield Response(detokenizer.add(token), token, replace(stats))  # stats as they are now
        finish = "length" if stats.generated == settings.max_tokens else "eos"
        learn_encoding_rate(models, settings, stats)
        yield Response(detokenizer.flush(), None, replace(stats), finish)

    return responses()


def generate(models: Models, prompt: str, **options) -> str:
    """The generated text; options as for stream_generate."""
    return "".join(response.text for response in stream_generate(models, prompt, **options))


def measure(models: Models, prompt: str, settings: Settings) -> Stats:
    """The statistics of one generation, its text unused (for timings)."""
    stats = Stats()
    for _ in generate_tokens(models, prompt, settings, stats):
        pass
    return stats


def measure_batch(models: Models, prompts: list[str], settings: Settings, batch_size: int) -> Stats:
    """Every prompt's statistics summed, with seconds the wall-clock time of
    the whole batch run and encoding_seconds its encoding (for timings)."""
    requests = [settings.request(prompt) for prompt in tokenize(models, prompts)]
    batch = batch_for(models, settings, batch_size)
    started = time.perf_counter()
    for _ in drive(batch, requests):
        pass
    total = sum((request.stats for request in requests), Stats())
    return replace(total, seconds=time.perf_counter() - started, encoding_seconds=batch.encoding_seconds)


WARM_UP_TOKENS = 64  # what is kept of a prompt too long to encode for a warm-up


def warm_up(models: Models, prompt: str, settings: Settings = Settings()) -> None:
    """A few tokens of each decoding path on the prompt, so that first-call
    costs (compiling kernels and the steps for its length, growing the
    allocator's pools) stay out of timings; a prompt whose encoding would
    take over a second is cut to its first WARM_UP_TOKENS tokens."""
    ids = models.tokenizer.encode(prompt)
    if len(ids) > WARM_UP_TOKENS and encoding_seconds(models, len(ids), settings) > 1.0:
        prompt = models.tokenizer.decode(ids[:WARM_UP_TOKENS])
    for speculative in (False, True) if replace(settings, speculative=True).drafts(models) else (False,):
        measure(models, prompt, replace(settings, max_tokens=4, speculative=speculative))


@dataclass
class Generation:
    """One prompt's whole generation: its text and token ids, its own
    statistics (seconds count from when its row joined the batch), and why
    it stopped, "eos" or "length"."""

    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str


def stream_batch_generate(models: Models, prompts: list[str], *, batch_size: int = 8, **options) -> Iterator[Generation]:
    """Decode prompts batch_size at a time and yield each one's Generation
    in input order, as soon as it and every prompt before it are done. Rows
    move independently: each accepts its own drafts, a finished row leaves
    the batch and waiting prompts take its place. Greedy at delta 0, each
    text equals `generate` on its prompt alone. Options as for
    stream_generate; they, batch_size and every prompt are checked at the call."""
    settings = Settings.of(options).check_models(models)
    BATCH_SIZE.check(batch_size)
    ids = tokenize(models, prompts)
    stats = [Stats() for _ in prompts]

    def generations():
        tokens, done, next_out = [[] for _ in prompts], [False] * len(prompts), 0
        for index, token, finished in decode_batch(models, ids, settings, stats, batch_size):
            tokens[index] += [] if token is None else [token]
            done[index] = finished
            while next_out < len(prompts) and done[next_out]:
                row = stats[next_out]
                finish = "length" if row.generated == settings.max_tokens else "eos"
                yield Generation(Detokenizer(models.tokenizer).decode(tokens[next_out]), tokens[next_out], row, finish)
                next_out += 1

    return generations()


def batch_generate(models: Models, prompts: list[str], *, batch_size: int = 8, **options) -> list[Generation]:
    """Every prompt's Generation, in input order (`[g.text for g in ...]`
    for the texts); options as for stream_batch_generate."""
    return list(stream_batch_generate(models, prompts, batch_size=batch_size, **options))
