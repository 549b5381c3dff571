"""What each rank of tests/test_pipeline.py's runs, as mlx.launch would run it on several machines:

    python tests/stage_rank.py TARGET DRAFT|- STAGES text|speech

Every rank loads the target split into STAGES (a count, or each stage's [encoder, decoder] layers, as JSON); rank 0
decodes every path and prints their tokens and each stage's memory (once loaded, and after) as one JSON
line; the other ranks compute their
stages and end with rank 0. `outputs` is also the tests' one-process reference."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

CLIP = ROOT / "demo" / "speech" / "clips" / "held-out-2.wav"
PROMPTS = ["translate English to French: Let's go to the store and buy some groceries including eggs.",
           "summarize: the cat sat on the mat and looked at the birds outside", "hello there"]
# Every text path, as batch_generate's options (those that draft, where a draft is loaded).
TEXT_PATHS = {
    "greedy": dict(speculative=False),
    "drafted": dict(num_draft=3),
    "auto": dict(num_draft="auto"),
    "sampled": dict(temp=0.8, seed=3, speculative=False),
    "sampled drafted": dict(temp=1.0, seed=5, num_draft=2),
    "beams": dict(num_beams=3, speculative=False),
}
SPEECH_PATHS = {"words": dict(words=True)}  # greedy, with each word's times (beams and timestamps: the text's paths)


def outputs(models, kind: str) -> dict:
    """Every path's tokens: each prompt's (text), or each segment's of a held-out clip (speech; with its words' times
    where they are asked)."""
    if kind == "speech":
        from options import Settings
        from speech import transcribe

        found = {}
        for name, options in SPEECH_PATHS.items():
            options = dict(options)
            timestamps, words = options.pop("timestamps", False), options.pop("words", False)
            (heard,) = transcribe(models, [str(CLIP)], settings=Settings(**options), timestamps=timestamps, words=words)
            found[name] = [segment["tokens"] for segment in heard.segments]
            if words:  # each word, and its times
                found[name] += [[[w["word"], w["start"], w["end"]] for w in segment["words"]] for segment in heard.segments]
        return found
    from dataclasses import replace

    from batches import batch_for, drive
    from generate import batch_generate
    from options import Settings
    from rows import Request

    drafts = models.draft is not None
    found = {name: [g.tokens for g in batch_generate(models, PROMPTS, max_tokens=16, **options)]
             for name, options in TEXT_PATHS.items() if drafts or options.get("speculative", True) is False}
    found["one at a time"] = [g.tokens for g in batch_generate(models, PROMPTS, batch_size=1, max_tokens=12,
                                                              **(dict(num_draft=2) if drafts else dict(speculative=False)))]
    # Rows of several lengths two at a time: as one leaves (its cross-attention cut to the longest prompt left),
    # the next joins (its caches appended to the batch's).
    settings = Settings(max_tokens=16, num_draft=2) if drafts else Settings(max_tokens=16, speculative=False)
    ids = [models.tokenizer.encode(prompt) for prompt in PROMPTS + PROMPTS[:1]]
    requests = [Request(prompt, replace(settings, max_tokens=n)) for prompt, n in zip(ids, (5, 14, 8, 11))]
    tokens = {id(request): [] for request in requests}
    for request, token, _ in drive(batch_for(models, settings, 2), requests):
        tokens[id(request)] += [] if token is None else [token]
    found["rows joining and leaving"] = [tokens[id(request)] for request in requests]
    return found


if __name__ == "__main__":
    from loading import load

    target, draft, stages, kind = sys.argv[1:5]
    models = load(target, draft=None if draft == "-" else draft, stages=json.loads(stages))
    loaded = models.target.memory()
    print(json.dumps(outputs(models, kind) | {"loaded": loaded, "memory": models.target.memory()}), flush=True)
