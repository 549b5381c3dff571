"""The text API: prompts in, text out, streamed or in batches, over the decoding engine (decoder.py).

    models = loading.load("mlx_models/t5-11b", draft="mlx_models/t5-small")
    text = generate(models, "translate English to German: Good morning.", num_draft=5)
    for response in stream_generate(models, prompt):
        print(response.text, end="", flush=True)

    generations = batch_generate(models, prompts, batch_size=8)   # many prompts, decoded together
    texts = [g.text for g in generations]

Options are options.Settings' fields, checked at the call. Drafts come from
the draft model, num_draft at a time or as many as num-draft auto finds worth
it (num_draft="auto"), or from the prompt (prompt_lookup=True, no draft
model). Text comes out of one text.TextStream per prompt, as the server's does.
"""

import time
import warnings
from dataclasses import dataclass, replace
from typing import Iterator

import cpu  # before mlx.core
import kernels

import batches
from batches import batch_for, drive
from rows import Logprob, Request
from errors import OptionError
from loading import Models
from model import EncoderDecoder
from options import BATCH_SIZE, Settings, Stats
from plans import Plan, PromptForm, resolve, with_presets
from text import TextStream, plural

TRAINED_LENGTH = 512  # T5's pre-training inputs; longer ones work, less well


def assumed_encoding_rate() -> float:
    """Encoding speed (flops/s) assumed until a long prompt measures it: on
    the CPU path the slow end of what 2 x86 cores did on T5-large and the
    demo target (30-140 G, by machine and length: `python -m bench encode`),
    so that a wait is announced, not missed."""
    return 30e9 if cpu.in_use() else 1e12


def encoding_flops(model: EncoderDecoder, tokens: int) -> float:
    """The work of encoding a prompt: its products (2 flops per weight and
    token, cross-attention keys and values included) and attention (its two
    products, 4 flops per query, key and inner dimension), which grows with
    the square of the length."""
    a = model.args
    inner = a.num_heads * a.d_kv
    ffn = (3 if a.feed_forward_proj.startswith("gated") else 2) * a.d_model * a.d_ff
    per_token = 2 * a.num_layers * (4 * a.d_model * inner + ffn) + 2 * a.num_decoder_layers * 2 * a.d_model * inner
    return tokens * per_token + 4 * a.num_layers * tokens * tokens * inner


def encoders(models: Models, settings: Settings) -> list[EncoderDecoder]:
    """The models that encode each prompt: the target, and the draft model when it drafts."""
    return [models.target] + ([models.draft] if settings.drafts(models) and not settings.prompt_lookup else [])


def encoding_seconds(models: Models, tokens: int, settings: Settings) -> float:
    """A rough estimate of a prompt's encoding, from the speed the pair's
    earlier prompts were encoded at."""
    flops = sum(encoding_flops(model, tokens) for model in encoders(models, settings))
    return flops / (models.learned.encoding_rate or assumed_encoding_rate())


def learn_encoding_rate(models: Models, settings: Settings, stats: Stats) -> None:
    """Keep the speed a prompt was encoded at, when it took long enough to tell."""
    if stats.encoding_seconds > 0.5:
        flops = sum(encoding_flops(model, stats.prompt_tokens) for model in encoders(models, settings))
        models.learned.encoding_rate = flops / stats.encoding_seconds


@dataclass
class Response:
    """One step of `stream_generate`: the new piece of text, a token it
    gave out (once no stop string can cut it), and the statistics so far
    (the engine's: a round may decode past a stop string). The last response
    has token None, carries any text held back until the end, and says why
    generation stopped: finish_reason "stop" (the end of the text, or a stop
    string) or "length" (max_tokens). With `logprobs=N` asked, `logprob`
    is the token's rows.Logprob: the target's log-probability of it,
    before processors and temperature (vLLM's default), and the N most
    likely tokens' (id, log-probability)."""

    text: str
    token: int | None
    stats: Stats
    finish_reason: str | None = None
    logprob: Logprob | None = None
    beams: list[tuple[str, float]] | None = None  # the last, with beam search: Generation.beams


@dataclass
class Generation:
    """One prompt's whole generation: its text and the token ids that made
    it, its own statistics (the engine's, as stream_generate's; seconds
    count from when its row joined the batch), and why it stopped, "stop"
    or "length"."""

    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str
    logprobs: list[Logprob] | None = None  # each token's, with logprobs=N asked (Response.logprob)
    beams: list[tuple[str, float]] | None = None  # beam search: the num_return_sequences best beams' texts and scores
    beam_tokens: list[list[int]] | None = None  # and each one's tokens, as `tokens` are the best's


def plan_for(models: Models, options: dict) -> Plan:
    """The options, resolved against these models (plans.resolve): keywords,
    over a `task=`'s and the model's generation defaults
    (plans.with_presets), over a whole Settings given as `settings=` (what
    the command line passes, its presets applied). TypeError for models that
    are not loading.load's, OptionError for an option out of range, a task
    the model's config does not name, or a language it does not know."""
    if not isinstance(models, Models):
        shown = f" {models!r}" if isinstance(models, str) else ""
        raise TypeError(f"models must be what loading.load returns (got {type(models).__name__}{shown}): "
                        "models = load(TARGET, draft=DRAFT)")
    options = dict(options)
    base, task = options.pop("settings", None), options.pop("task", None)
    if base is not None and not isinstance(base, Settings):
        raise TypeError(f"settings must be an options.Settings (got {type(base).__name__})")
    # Settings given whole have the model's generation defaults already (the command line's: main.with_presets)
    prefix, base, _ = with_presets(models, base or Settings(), given=options, task=task, generation=base is None)
    return resolve(Settings.of(options, base), models, prefix)


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


def tokenize(models: Models, prompts: list[str], form: PromptForm = PromptForm()) -> list[list[int]]:
    """Each prompt's ids, in the prompts' form. OptionError for an empty
    prompt; a warning for prompts longer than T5 was trained on."""
    check_prompts(prompts)
    for number, prompt in enumerate(prompts, 1):
        if not prompt.strip():
            raise OptionError("the prompt is empty" if len(prompts) == 1 else f"prompt {number} of {len(prompts)} is empty")
    ids = [form.ids(models, prompt) for prompt in prompts]
    longest = max(len(i) for i in ids)
    limit = models.longest_input
    if limit is not None and longest > limit:
        raise OptionError(f"a prompt has {longest:,} tokens: this model's positions stop at {limit:,}")
    if limit is None and longest > TRAINED_LENGTH:
        long = sum(len(i) > TRAINED_LENGTH for i in ids)
        which = "the prompt has" if len(ids) == 1 else f"{plural(long, 'prompt')} {'has' if long == 1 else 'have'} up to"
        warnings.warn(f"{which} {longest:,} tokens, more than the {TRAINED_LENGTH} T5 was trained on: "
                      "the output may suffer", RuntimeWarning, stacklevel=4)
    return ids


def one_prompt(models: Models, prompt: str, form: PromptForm = PromptForm()) -> list[int]:
    if not isinstance(prompt, str):
        raise TypeError(f"the prompt must be a string (got {type(prompt).__name__})")
    return tokenize(models, [prompt], form)[0]


def stream_generate(models: Models, prompt: str, **options) -> Iterator[Response]:
    """Yield a Response as each token is decided. Options, all keywords:
    max_tokens=100, num_draft=5 (or "auto": see autodraft.AutoDraft),
    delta=0.0, temp=0.0, top_k=0, top_p=1.0, seed=None (the same seed, the
    same draws for the same prompt; None: drawn from MLX's generator),
    speculative=True (False: the target alone, even with a draft),
    prompt_lookup=False (True: drafts copied from the prompt and the output,
    see drafting.PromptLookup; a draft model, if loaded, is not used),
    stop=() (strings the text ends before), ignore_eos=False (decode on to
    max_tokens), skip_special_tokens=False (True: no <extra_id_0>, </s> or
    <pad> in the text), logprobs=None (N: each Response's logprob); the
    processors repetition_penalty, presence_penalty, frequency_penalty,
    min_tokens, no_repeat_ngram_size, stop_token_ids and logit_bias; beam
    search, num_beams=1 (more: the target alone, greedy; its best beam is
    the text), length_penalty=1.0, early_stopping=False (True, or "never"),
    num_return_sequences=1 (batch_generate's Generation.beams); task=None
    (a task the model's config names, "summarization" say: its prompt
    prefix, and its options under those given); src_lang and tgt_lang (a
    multilingual model's language codes, "eng_Latn" say); or settings=, a whole options.Settings, with any keywords
    over it. Options and the prompt are checked at the call, before any
    decoding: OptionError names one out of range."""
    plan = plan_for(models, options)
    settings = plan.settings
    if settings.n > 1:
        raise OptionError(f"n={settings.n}: stream_generate and generate give one output; batch_generate gives n")
    request = plan.request(one_prompt(models, prompt, plan.form))
    stream = TextStream.of(models.tokenizer, settings)

    def responses():
        given, text = 0, ""  # tokens given out (each once no stop string can cut it), text not yet with one
        for _, token, finish in drive(batch_for(models, settings, 1), [request]):
            stream.add(token, finish)
            text += stream.take()
            for settled in stream.tokens[given : stream.settled]:
                logprob = request.logprobs[given] if settings.logprobs is not None else None
                yield Response(text, settled, replace(request.stats), logprob=logprob)  # stats as they are now
                text, given = "", given + 1
            if stream.finish_reason:
                break
        learn_encoding_rate(models, settings, request.stats)
        yield Response(text + stream.take(), None, replace(request.stats), stream.finish_reason,
                       beams=beam_texts(models, settings, request))

    return responses()


def generate(models: Models, prompt: str, **options) -> str:
    """The generated text; options as for stream_generate."""
    return "".join(response.text for response in stream_generate(models, prompt, **options))


def beam_texts(models: Models, settings: Settings, request: Request) -> list[tuple[str, float]] | None:
    """A beam search's best beams, as texts with their scores; None without beam search."""
    beams = searched_beams(models, settings, request)
    return [(text, score) for text, score, _ in beams] if beams else None


def searched_beams(models: Models, settings: Settings, request: Request) -> list[tuple[str, float, list[int]]]:
    """A beam search's best beams: each one's text, score and the tokens of its text (a stop string cuts both)."""
    beams = []
    for tokens, score, finish in request.sequences:
        stream = TextStream.of(models.tokenizer, settings)
        beams.append((stream.whole(tokens, finish), score, stream.text_tokens))
    return beams


def texts(batch, requests: list[Request], streams: dict) -> Iterator[Request]:
    """Decode requests through a batch, each token into its request's text
    stream (streams: by id(request)); yield each request as its text ends.
    A row whose text ended at a stop string leaves at the next round."""
    stopped = set()
    for request, token, finish in drive(batch, requests, stopped):
        stream = streams[id(request)]
        if stream.finish_reason is None:
            stream.add(token, finish)
            if stream.finish_reason:
                if finish is None:
                    stopped.add(request)
                yield request


def stream_batch_generate(models: Models, prompts: list[str], *, batch_size: int = 8, **options) -> Iterator[Generation]:
    """Decode prompts batch_size at a time and yield each one's Generation
    (n of them, with n=) in input order, as soon as it and every prompt before it are done. Rows
    move independently: each accepts its own drafts, a finished row leaves
    the batch and waiting prompts take its place. Greedy at delta 0, each
    text equals `generate` on its prompt alone. Options as for
    stream_generate; they, batch_size and every prompt are checked at the call."""
    plan = plan_for(models, options)
    settings = plan.settings
    BATCH_SIZE.check(batch_size)
    # n outputs of each prompt: its rows join together, and the prompt is encoded once
    requests = [plan.request(ids, copy) for ids in tokenize(models, prompts, plan.form) for copy in settings.copies()]
    streams = {id(request): TextStream.of(models.tokenizer, settings) for request in requests}

    def generations():
        done, next_out = {}, 0
        for request in texts(batch_for(models, settings, batch_size), requests, streams):
            stream = streams[id(request)]
            # stats as they are now: a row stopped by a stop string decodes on to the next round
            logprobs = request.logprobs[: stream.received] if settings.logprobs is not None else None
            beams = searched_beams(models, settings, request)
            done[id(request)] = Generation(stream.take(), stream.text_tokens, replace(request.stats), stream.finish_reason,
                                           logprobs, [(text, score) for text, score, _ in beams] or None,
                                           [tokens for _, _, tokens in beams] or None)
            while next_out < len(requests) and id(requests[next_out]) in done:
                yield done.pop(id(requests[next_out]))
                next_out += 1

    return generations()


def batch_generate(models: Models, prompts: list[str], *, batch_size: int = 8, **options) -> list[Generation]:
    """Every prompt's Generation, in input order (`[g.text for g in ...]`
    for the texts); options as for stream_batch_generate."""
    return list(stream_batch_generate(models, prompts, batch_size=batch_size, **options))


def measure(models: Models, prompt: str, settings: Settings) -> Stats:
    """The statistics of one generation, ended as its text is (at a stop
    string too), its text unused (for timings)."""
    return measure_batch(models, [prompt], settings, 1, wall_clock=False)


def measure_batch(models: Models, prompts: list[str], settings: Settings, batch_size: int, wall_clock: bool = True) -> Stats:
    """Every prompt's statistics summed, ended as their texts are (for
    timings); with wall_clock, seconds is the whole batch run's,
    encoding_seconds its encoding and compiling_seconds MLX's compiling."""
    plan = resolve(settings, models)
    requests = [plan.request(ids) for ids in tokenize(models, prompts, plan.form)]
    streams = {id(request): TextStream.of(models.tokenizer, settings) for request in requests}
    batch = batch_for(models, settings, batch_size)
    started, compiled = time.perf_counter(), kernels.compiling_seconds()
    for _ in texts(batch, requests, streams):
        pass
    total = sum((request.stats for request in requests), Stats())
    if not wall_clock:
        return total
    seconds = time.perf_counter() - started
    compiling = min(max(kernels.compiling_seconds() - compiled, 0.0), seconds - batch.encoding_seconds)  # (others' count too)
    return replace(total, seconds=seconds, encoding_seconds=batch.encoding_seconds, compiling_seconds=compiling)


WARM_UP_TOKENS = 64  # what is kept of a prompt too long to encode for a warm-up


def warm_up(models: Models, prompt: str, settings: Settings = Settings()) -> None:
    """batches.warm_up on the prompt, cut to its first WARM_UP_TOKENS tokens
    when its encoding would take over a second, or it runs past the model's
    positions (the run that follows refuses it in a line)."""
    ids = models.tokenizer.encode(prompt)
    past_positions = models.longest_input is not None and len(ids) > models.longest_input  # the run itself refuses it
    if len(ids) > WARM_UP_TOKENS and (past_positions or encoding_seconds(models, len(ids), settings) > 1.0):
        ids = models.tokenizer.encode(models.tokenizer.decode(ids[:WARM_UP_TOKENS]))
    batches.warm_up(models, ids, settings)
