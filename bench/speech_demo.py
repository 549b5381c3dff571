"""speech-demo: the speech demo (Whisper tiny.en and the draft in demo/speech, made by demo/train_speech.py) on
held-out sentences that espeak-ng speaks here (training's accents, voice variants, speeds and pitches, drawn with a
seed of their own): the target's word error rate, greedy; how often the draft's tokens are accepted; speculative
decoding against regular decoding, one clip at a time, as `main.py --demo --audio` runs, on those sentences and on
the shipped clips (the demo's own line, its measure); and a long file of several sentences with pauses, decoded
long-form, its segments against where each sentence was placed."""

import hashlib
import statistics
import sys
import time

import numpy as np

from bench.harness import DEMO, alternate, table, warm_up_note

SPEECH = DEMO / "speech"
SENTENCES = 100  # held-out sentences, each spoken once
SPEED_CLIPS = 20  # of them, transcribed one at a time for the speed runs
LONG_SENTENCES = 14  # in the long file, with pauses between them
SEED = 11  # the voices drawn here (training draws with its --seed and the next, write_clips with 7)
NUM_DRAFTS = (1, 2, 3, 4, 6)
WINDOW = 30  # seconds: a clip longer than the window is left out


def spoken(sentences: list[str], voices: list[str], seed: int, longest: float) -> tuple[list[str], list[np.ndarray]]:
    """Each sentence spoken once (train_speech's voices, speeds and pitches), those a window holds whole."""
    import train_speech as ts

    samples, clips = ts.synthesize(sentences, 1, seed, voices)
    kept = [(sentences[i], samples[offset:offset + length].numpy()) for i, offset, length in clips
            if length <= longest * ts.RATE]
    return [sentence for sentence, _ in kept], [clip for _, clip in kept]


def long_file(sentences: list[str], clips: list[np.ndarray], seed: int) -> tuple[np.ndarray, list[tuple]]:
    """The clips one after another with pauses of 0.6 to 2 s (and 1 s of quiet at each end), in light noise; each
    sentence's (start, end) in seconds (where its sound starts and ends: speak() trims espeak-ng's silence)."""
    import audio

    rng, rate = np.random.default_rng(seed), audio.SAMPLE_RATE
    pieces, placed, at = [np.zeros(rate, np.float32)], [], 1.0
    for sentence, clip in zip(sentences, clips):
        placed.append((sentence, round(at, 3), round(at + len(clip) / rate, 3)))
        pause = np.zeros(int(rng.uniform(0.6, 2.0) * rate), np.float32)
        pieces += [clip, pause]
        at += (len(clip) + len(pause)) / rate
    samples = np.concatenate(pieces + [np.zeros(rate, np.float32)])
    return samples + 1e-3 * rng.standard_normal(len(samples)).astype(np.float32), placed


def matched(segments: list[dict], placed: list[tuple]) -> list[dict]:
    """Each segment against the sentence it overlaps most: the differences of their starts and ends, in seconds."""
    rows = []
    for segment in segments:
        overlap = [min(segment["end"], end) - max(segment["start"], start) for _, start, end in placed]
        best = int(np.argmax(overlap))
        if overlap[best] > 0:
            _, start, end = placed[best]
            rows.append({"sentence": best, "start": round(segment["start"] - start, 2),
                         "end": round(segment["end"] - end, 2)})
    return rows


def run_speech_demo(args) -> dict:
    import io
    import json

    import main
    import real_whisper
    import speech
    import train_speech as ts
    from audio import read
    from display import show_transcription_speedup
    from loading import load

    record = json.loads((SPEECH / "training.json").read_text())
    voices = record["voices"]
    held = sorted((s for s in ts.corpus_sentences() if ts.held_out(s)), key=lambda s: hashlib.sha1(s.encode()).digest())
    sentences, clips = spoken(held[:SENTENCES + 20], voices, SEED, WINDOW - 0.5)
    sentences, clips = sentences[:SENTENCES], clips[:SENTENCES]
    models = load(str(real_whisper.demo_target()), draft=str(SPEECH / "draft"))

    def heard(**options) -> list:
        return speech.transcribe(models, clips, **options)

    regular = heard(speculative=False)
    exact = all([t.tokens for t in heard(speculative=True, num_draft=k, delta=0.0)] == [t.tokens for t in regular]
                for k in NUM_DRAFTS)
    print("held-out sentences: done", file=sys.stderr)
    decoded = {}  # each contender's runs: (decoding seconds, tokens, drafts accepted, drafted) of its clips

    def one_at_a_time(name, **options):
        def run():
            start, totals = time.perf_counter(), np.zeros(4)
            for clip in clips[:SPEED_CLIPS]:
                (transcription,) = speech.transcribe(models, [clip], **options)
                stats = transcription.stats
                totals += (stats.decoding_seconds, stats.generated, stats.accepted, stats.drafted)
            decoded.setdefault(name, []).append(totals.tolist())
            return time.perf_counter() - start, None
        return run

    runs = {"regular": one_at_a_time("regular", speculative=False)} | {
        f"num-draft {k}": one_at_a_time(f"num-draft {k}", speculative=True, num_draft=k, delta=0.0) for k in NUM_DRAFTS}
    timings = alternate(runs, args.repeats)
    print("speed: done", file=sys.stderr)
    shipped = json.loads((SPEECH / "clips" / "clips.json").read_text())
    settings = main.knob_settings(main.build_parser().parse_args([]), main.SPEECH_DEFAULTS)
    demo = {clip["file"]: round(show_transcription_speedup(models, read(str(SPEECH / "clips" / clip["file"])),
                                                           {"settings": settings}, out=io.StringIO()), 3)
            for clip in shipped}

    long_sentences, long_clips = spoken(held[SENTENCES + 20:SENTENCES + 20 + LONG_SENTENCES], voices, SEED + 1,
                                        WINDOW - 0.5)
    samples, placed = long_file(long_sentences, long_clips, SEED)
    (long,) = speech.transcribe(models, [samples], timestamps=True)
    return {
        "training": {key: record[key] for key in ("steps", "training_seconds", "parameters", "voices", "head_tokens")}
        | {"draft_agreement": record["held_out"]["draft_agreement"],
           "word_error_rate": record["held_out"]["target_word_error_rate"]},
        "demo": {"num_draft": settings.num_draft, "speedups": demo},
        "sentences": len(sentences), "audio_seconds": round(sum(map(len, clips)) / ts.RATE, 1),
        "word_error_rate": ts.word_error_rate(sentences, [t.text for t in regular]),
        "examples": [{"sentence": s, "heard": t.text} for s, t in list(zip(sentences, regular))[:6]],
        "exact": exact, "repeats": args.repeats, "speed_clips": SPEED_CLIPS,
        "seconds": {name: timing.seconds for name, timing in timings.items()},
        "warm_ups": {name: timing.warm_ups for name, timing in timings.items()},
        # the timed runs' (the last `repeats` of each contender's): decoding seconds, tokens, drafts accepted, drafted
        "decoded": {name: runs[-args.repeats:] for name, runs in decoded.items()},
        "long": {"seconds": round(len(samples) / ts.RATE, 1), "placed": placed, "text": long.text,
                 "word_error_rate": ts.word_error_rate([" ".join(s for s, _, _ in placed)], [long.text]),
                 "segments": [{key: segment[key] for key in ("start", "end", "text")} for segment in long.segments],
                 "matched": matched(long.segments, placed)},
    }


def render_speech_demo(data: dict) -> str:
    def rate(name):  # decoding's tokens a second (encoding, the same for both, left out), the median run's
        return statistics.median(tokens / seconds for seconds, tokens, _, _ in data["decoded"][name])

    regular = statistics.median(data["seconds"]["regular"])
    rows = [["regular", "-", f"{regular / data['speed_clips'] * 1000:.0f} ms", "1.00x", f"{rate('regular'):.0f}", "1.00x"]]
    for name in data["seconds"]:
        if name != "regular":
            _, _, accepted, drafted = data["decoded"][name][-1]
            seconds = statistics.median(data["seconds"][name])
            rows.append([name, f"{accepted / drafted:.2f}", f"{seconds / data['speed_clips'] * 1000:.0f} ms",
                         f"{regular / seconds:.2f}x", f"{rate(name):.0f}", f"{rate(name) / rate('regular'):.2f}x"])
    long, training = data["long"], data["training"]
    starts = [abs(row["start"]) for row in long["matched"]]
    ends = [abs(row["end"]) for row in long["matched"]]
    timing = (f"segments' starts {statistics.median(starts):.2f} s and ends {statistics.median(ends):.2f} s from the "
              f"sentences' (medians)" if starts else "no segment overlaps a sentence")
    return (f"{data['sentences']} held-out sentences ({data['audio_seconds']} s), each spoken once by espeak-ng in "
            f"voices drawn anew: the target's word error rate, greedy, **{data['word_error_rate']:.3f}**; "
            f"drafted output equal to regular output at every num-draft: {'yes' if data['exact'] else '**no**'}. "
            f"Training's own held-out figures (training.json, {training['steps']:,} steps): word error rate "
            f"{training['word_error_rate']:.3f}, the draft's token the target's {training['draft_agreement']:.2f} of the "
            f"time.\n\nOne clip at a time, as `main.py --demo --audio` runs: a clip's time from its samples to its text "
            f"(encoding included, "
            f"the same for both: the draft decodes on the target's encoder output), {data['speed_clips']} clips a run, "
            f"medians of {data['repeats']} alternating runs; decoding's own tokens a second, the median run's; the "
            f"share of drafts accepted, of those clips':\n\n"
            + table(["decoding", "drafts accepted", "a clip", "speedup", "decoding tokens/s", "decoding speedup"], rows)
            + f"\n\nThe shipped clips, as `--demo --audio` measures each (num-draft {data['demo']['num_draft']}: "
              f"decoding's tokens a second drafted over regular, medians of 5 alternating runs): "
              + ", ".join(f"{speedup:.2f}x" for speedup in data["demo"]["speedups"].values())
            + f".\n\nLong-form: {len(long['placed'])} sentences with pauses, {long['seconds']} s; "
              f"{len(long['segments'])} segments ({len(long['segments']) - len(long['matched'])} overlapping no "
              f"sentence), word error rate {long['word_error_rate']:.3f}; {timing}."
            + warm_up_note(data["warm_ups"]))
