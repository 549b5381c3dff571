"""How a generation is shown at a terminal: its text as it streams, the statistics line, what was asked beside the
text (beams, logprobs), a batch's outputs, the speedup over regular decoding, a span-corruption prompt filled in,
and the warm-up said out loud. The command line (main.py) and the loop (interactive.py) show through these.
"""

import re
import statistics
import sys
import time
from dataclasses import replace

import kernels
from generate import encoding_seconds, measure, stream_generate, warm_up
from loading import Models
from options import Settings, Stats
from text import plural

SENTINEL = re.compile(r"<extra_id_(\d+)>")


def stats_line(stats: Stats, speculative: bool, source: str | None = None) -> str:
    """`source`: what was encoded, where it is not a prompt of stats.prompt_tokens tokens (a clip's seconds)."""
    source = source or f"prompt {plural(stats.prompt_tokens, 'token')}"
    line = (f"{plural(stats.generated, 'token')} in {stats.decoding_seconds:.2f} s ({stats.tokens_per_second:.1f} tokens/s), "
            f"{source} encoded in {stats.encoding_seconds:.2f} s")
    if stats.compiling_seconds >= 0.005:
        line += f", MLX compiling kernels {stats.compiling_seconds:.2f} s (once on this machine)"
    if speculative:
        return (
            f"Accepted {stats.accepted} / {plural(stats.drafted, 'draft')} ({stats.acceptance_rate:.0%}; "
            f"{stats.drafts_per_round:.1f} a round), "
            f"{plural(stats.target_calls, 'decode step')} ({stats.tokens_per_target_call:.2f} tokens each), " + line
        )
    return f"{plural(stats.target_calls, 'decode step')}, " + line


def warm_up_aloud(models: Models, prompt: str, settings: Settings, out=None) -> None:
    """generate.warm_up before anything is timed, said (on stderr, or `out`)
    when it took a while (MLX compiling its kernels for these settings, once
    on this machine, tracing the steps' graphs), which no timing then counts."""
    compiled, compiling, started = kernels.compiled_kernels(), kernels.compiling_seconds(), time.perf_counter()
    warm_up(models, prompt, settings)
    seconds = time.perf_counter() - started
    if kernels.compiled_kernels() > compiled:
        print(f"Warmed up in {seconds:.1f} s, {kernels.compiling_seconds() - compiling:.1f} s of them MLX compiling "
              f"{plural(kernels.compiled_kernels() - compiled, 'kernel')} for these settings (once on this machine)",
              file=out or sys.stderr, flush=True)
    elif seconds > 2:
        print(f"Warmed up in {seconds:.1f} s", file=out or sys.stderr, flush=True)


def announce_encoding(models: Models, prompt: str, settings: Settings) -> None:
    """Say on stderr, before it starts, that a prompt will take a while to encode."""
    tokens = len(models.tokenizer.encode(prompt))
    seconds = encoding_seconds(models, tokens, settings)
    if seconds > 3:
        print(f"Encoding a {tokens:,}-token prompt: about {seconds:.0f} s ...", file=sys.stderr, flush=True)


def show_generation(models: Models, prompt: str, settings: Settings, out=None) -> tuple[str, Stats]:
    """Stream the text as it comes, then the statistics line. A prompt that
    will take a while to encode is announced on stderr first. Ctrl-C stops
    the generation with the statistics so far, and is raised again."""
    out = out or sys.stdout
    announce_encoding(models, prompt, settings)
    pieces, stats, logprobs, last = [], None, [], None
    try:
        for response in stream_generate(models, prompt, settings=settings):
            out.write(response.text)
            out.flush()
            pieces.append(response.text)
            stats, last = response.stats, response
            if response.logprob is not None:
                logprobs.append((response.token, response.logprob))
    except KeyboardInterrupt:
        print(file=out)
        if stats is not None:
            print(stats_line(stats, settings.drafts(models)) + " [stopped]", file=out, flush=True)
        raise
    print(file=out)
    show_asked(models.tokenizer, last.beams, logprobs, out)
    print(stats_line(stats, settings.drafts(models)), file=out)
    return "".join(pieces), stats


def show_asked(tokenizer, beams: list | None, logprobs: list, out=None) -> None:
    """What a generation gives beside its text when asked: the beams after the
    best, and each token's (token, logprob) as a table."""
    for number, (text, score) in enumerate((beams or [])[1:], 2):
        print(f"beam {number} (score {score:.3f}): {text}", file=out)
    if logprobs:
        print(logprob_table(tokenizer, logprobs), file=out)


def logprob_table(tokenizer, logprobs: list) -> str:
    """Each output token's log-probability, and the most likely tokens', a line each."""
    def shown(token: int) -> str:
        return repr(tokenizer.decode([token]))

    lines = ["token            logprob   most likely"]
    for token, (logprob, top) in logprobs:
        lines.append(f"{shown(token):<16} {logprob:8.3f}   " + "  ".join(f"{shown(t)} {v:.3f}" for t, v in top))
    return "\n".join(lines)


def show_batch(generations, count: int, speculative: bool, tokenizer, out=None, per_prompt: int = 1) -> Stats:
    """Each prompt's text (per_prompt of them, n outputs), what it was asked
    for beside (beams, logprobs) and statistics line as it comes (in input
    order), then the whole run's throughput; the summed statistics."""
    started, total, compiling = time.perf_counter(), Stats(), kernels.compiling_seconds()
    for number, generation in enumerate(generations):
        prompt, output = divmod(number, per_prompt)
        which = f"prompt {prompt + 1} of {count}" + (f", output {output + 1} of {per_prompt}" if per_prompt > 1 else "")
        print(f"--- {which}\n{generation.text}", file=out)
        show_asked(tokenizer, generation.beams, list(zip(generation.tokens, generation.logprobs or [])), out)
        print(stats_line(generation.stats, speculative), file=out, flush=True)
        total += generation.stats
    wall = time.perf_counter() - started
    compiling = min(kernels.compiling_seconds() - compiling, wall)  # (another process's compiles count too)
    seconds = wall - compiling
    speed = f"{total.generated / seconds:.1f}" if seconds > 0 else "-"
    print(f"--- {plural(count, 'prompt')}: {plural(total.generated, 'token')} in {seconds:.2f} s ({speed} tokens/s)"
          + (f", MLX compiling kernels {compiling:.2f} s more (once on this machine)" if compiling >= 0.005 else ""),
          file=out)
    return total


def why_not_timed(settings: Settings, mode: str, prefix: str) -> str | None:
    """Why `mode` (compare or sweep: they time one output of speculative decoding) cannot run at these settings, its
    options named with `prefix` (the command line's "--", the loop's ":"); None when it can."""
    if settings.n > 1:
        return f"{prefix}n gives several outputs of a prompt: {prefix}{mode} times one"
    if settings.num_beams > 1:
        return f"{prefix}num-beams searches with the target alone: {prefix}{mode} measures speculative decoding"
    return None


def compare(models: Models, prompt: str, settings: Settings, out=None) -> None:
    """Regular then speculative decoding of one prompt, with times and speedup."""
    warm_up_aloud(models, prompt, settings)
    results = {}
    for speculative in (False, True):
        label = "speculative" if speculative else "regular"
        print(f"--- {label}", file=out)
        _, results[label] = show_generation(models, prompt, replace(settings, speculative=speculative), out)
    regular, spec = results["regular"], results["speculative"]
    speedup = spec.tokens_per_second / regular.tokens_per_second if regular.tokens_per_second else 0.0
    lookup = ", prompt lookup" if settings.prompt_lookup else ""
    print(f"decoding: regular {regular.decoding_seconds:.2f} s, speculative {spec.decoding_seconds:.2f} s, "
          f"speedup {speedup:.2f}x "
          f"(num-draft {settings.num_draft}, delta {settings.delta}{lookup})", file=out)


SPEEDUP_SECONDS = 5.0  # the most show_speedup may take


def show_speedup(models: Models, prompt: str, settings: Settings, answer: Stats, runs: int = 5, out=None) -> float | None:
    """Time both modes on the prompt, alternating, and print the speedup of
    the medians of their decoding speeds: a short generation's single timing
    is too noisy to quote. A run of each mode costs about twice the answer
    (`answer`, its statistics: each run encodes the prompt again), so the
    runs are cut to what fits in SPEEDUP_SECONDS, and none is made when not
    even one of each fits (None). Run it warm (after warm_up)."""
    pair = 2 * (answer.seconds - answer.compiling_seconds)  # the kernels it compiled are there for the runs
    runs = min(runs, int(SPEEDUP_SECONDS // pair)) if pair > 0 else runs
    if runs == 0:
        print(f"(Speedup not measured: a run of each mode would take about {pair:.0f} s, more than the "
              f"{SPEEDUP_SECONDS:.0f} s this line may take; `main.py --compare` runs each once.)", file=out)
        return None
    speedup, spec, regular = alternated(
        lambda speculative: measure(models, prompt, replace(settings, speculative=speculative)).tokens_per_second, runs)
    how = f"medians of {runs} runs each" if runs > 1 else "one run each"
    if runs < 5:
        how += f": a run of each takes about {pair:.1f} s"
    print(f"Speculative decoding ran {speedup:.2f}x as fast as regular decoding on this prompt "
          f"({spec:.0f} against {regular:.0f} tokens/s, {how})", file=out)
    return speedup


def alternated(rate, runs: int) -> tuple[float, float, float]:
    """rate(speculative) -> tokens/s, run for regular then speculative decoding, `runs` times: the speedup of the
    medians, and the medians (speculative, regular)."""
    times = {False: [], True: []}
    for _ in range(runs):
        for speculative in (False, True):
            times[speculative].append(rate(speculative))
    regular, spec = statistics.median(times[False]), statistics.median(times[True])
    return (spec / regular if regular else 0.0), spec, regular


def show_transcription_speedup(models: Models, samples, options: dict, runs: int = 5, out=None) -> float:
    """Transcribe the clip regular and drafted, alternating, and print the speedup of the medians of their decoding
    speeds (as show_speedup does for a prompt; a clip of a few seconds decodes in a fraction of one)."""
    from speech import transcribe

    def rate(speculative: bool) -> float:
        settings = replace(options["settings"], speculative=speculative)
        (transcription,) = transcribe(models, [samples], **(options | {"settings": settings}))
        return transcription.stats.tokens_per_second

    speedup, spec, regular = alternated(rate, runs)
    print(f"Speculative decoding decoded {speedup:.2f}x as fast as regular decoding on this clip "
          f"({spec:.0f} against {regular:.0f} tokens/s, medians of {runs} runs each)", file=out)
    return speedup


def fill_spans(prompt: str, output: str) -> str:
    """The prompt with each <extra_id_N> replaced by the span the model wrote
    after it in its output, marked «like this»."""
    pieces = SENTINEL.split(output)  # text, id, span, id, span, ...
    spans = {int(pieces[i]): pieces[i + 1].strip() for i in range(1, len(pieces) - 1, 2)}
    return SENTINEL.sub(lambda m: f"«{spans.get(int(m.group(1)), '?')}»", prompt)


def show_filled(prompt: str, output: str, out=None) -> None:
    """For a span-corruption prompt (T5's pre-training task), the prompt with its spans filled in."""
    if SENTINEL.search(prompt) and SENTINEL.search(output):
        print(f"\nFilled in:\n{fill_spans(prompt, output)}", file=out)
