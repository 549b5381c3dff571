"""Batched decoding: every row is what its prompt gives alone, and batches cost no more than their rows."""

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
from checkpoints import PROMPTS, exact_first_token_distribution
from support import chi_square_passes, decode, decode_batch, regular

import main
import mlx.core as mx
from rows import Request
from generate import batch_generate, generate, stream_generate
from loading import Models, load_tokenizer
from cache import KVCache
from options import Settings, Stats
from test_model import append

# Nine prompts from 3 to ~90 tokens: padding matters in the encoder and in cross-attention.
LENGTHS = [3, 90, 12, 40, 5, 64, 27, 8, 50]


@pytest.fixture(scope="module")
def prompts(pair, tokenizer):
    words = " ".join(PROMPTS).split()
    ids = [tokenizer.encode(" ".join(words[i : i + n]))[: n - 1] + [1] for i, n in enumerate(LENGTHS)]
    assert sorted(len(p) for p in ids) == sorted(LENGTHS)
    return ids


def counts(stats: Stats) -> dict:
    return {name: value for name, value in asdict(stats).items() if not name.endswith("seconds")}  # all but timings


def alone(models: Models, prompt: list[int], settings: Settings) -> tuple[list[int], Stats]:
    stats = Stats()
    return decode(models, prompt, settings, stats), stats


def requests_for(prompts: list[list[int]], settings: Settings) -> list[Request]:
    return [Request(prompt, settings) for prompt in prompts]


DRAFTED = Settings(max_tokens=24, num_draft=3)


@pytest.fixture(scope="module")
def drafted_alone(pair, prompts) -> list[tuple[list[int], Stats]]:
    """Each prompt drafted alone (DRAFTED): its tokens and counts, made once for every batch size."""
    return [alone(Models(pair["target"], pair["drafts"]["close"]), p, DRAFTED) for p in prompts]


@pytest.fixture(scope="module")
def regular_alone(pair, prompts) -> list[list[int]]:
    """Each prompt's 20 greedy tokens from the target alone, made once for every num-draft."""
    return [regular(pair["target"], prompt, 20) for prompt in prompts]


@pytest.mark.parametrize("batch_size", range(1, 9))
def test_batched_greedy_rows_equal_each_prompt_decoded_alone(pair, prompts, drafted_alone, batch_size):
    """Nine prompts of 3 to 90 tokens, more than a batch holds: rows join, accept different
    numbers of drafts and finish at different rounds, and each row's tokens and counts are
    exactly those of its prompt decoded alone (which equal transformers' greedy: test_speculative)."""
    models, settings, expected = Models(pair["target"], pair["drafts"]["close"]), DRAFTED, drafted_alone
    requests = requests_for(prompts, settings)
    tokens, finished = decode_batch(models, requests, batch_size)
    for i, (want, want_stats) in enumerate(expected):
        assert tokens[i] == want, f"prompt {i}"
        assert counts(requests[i].stats) == counts(want_stats), f"prompt {i}"
    assert sorted(finished) == list(range(len(prompts)))
    assert len({r.stats.target_calls for r in requests}) > 1, "rows must finish after different numbers of rounds"


@pytest.mark.parametrize("num_draft", range(1, 9))
def test_batched_greedy_equals_alone_at_every_num_draft(pair, prompts, regular_alone, num_draft):
    target, draft = pair["target"], pair["drafts"]["close"]
    requests = requests_for(prompts, Settings(max_tokens=20, num_draft=num_draft))
    tokens, _ = decode_batch(Models(target, draft), requests, 4)
    assert tokens == regular_alone
    accepted, drafted = sum(r.stats.accepted for r in requests), sum(r.stats.drafted for r in requests)
    assert 0 < accepted < drafted, "needs acceptances and rejections"


@pytest.mark.parametrize("batch_size", [3, 8])
def test_rows_stopping_at_eos_in_different_rounds_leave_and_the_rest_stay_exact(pair, prompts, batch_size, eos_at):
    """Each row reaches EOS (position 7) in a round of its own, since rows accept
    different numbers of drafts; the remaining rows and the joining ones are unaffected."""
    target, draft = eos_at(pair["target"], 7), pair["drafts"]["close"]
    requests = requests_for(prompts, Settings(max_tokens=40, num_draft=4))
    tokens, finished = decode_batch(Models(target, draft), requests, batch_size)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == regular(target, prompt, 40), f"prompt {i}"
        assert len(tokens[i]) == 7
    assert len({r.stats.target_calls for r in requests}) > 1


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_regular_batch_rows_equal_each_prompt_alone(pair, prompts, batch_size, eos_at):
    target = eos_at(pair["target"], 9)  # some rows stop at EOS, the others at max_tokens
    short = [p if i % 2 else p[:1] for i, p in enumerate(prompts)]  # a 1-token prompt: EOS alone
    requests = requests_for(short, Settings(max_tokens=12, speculative=False))
    tokens, finished = decode_batch(Models(target), requests, batch_size)
    for i, prompt in enumerate(short):
        single = Stats()
        assert tokens[i] == regular(target, prompt, 12, single), f"prompt {i}"
        assert counts(requests[i].stats) == counts(single)
    assert sorted(finished) == list(range(len(short)))


@pytest.mark.parametrize("delta", [0.3, 1.0])
def test_each_row_follows_the_single_prompt_acceptance_rule_at_delta(unit_scale_pair, tokenizer, delta):
    """Greedy with delta > 0 is deterministic: each row accepts exactly what its prompt accepts alone."""
    models, settings = Models(*unit_scale_pair), Settings(max_tokens=32, num_draft=4, delta=delta)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    requests = requests_for(prompts, settings)
    tokens, _ = decode_batch(models, requests, 4)
    for i, prompt in enumerate(prompts):
        want, want_stats = alone(models, prompt, settings)
        assert tokens[i] == want and counts(requests[i].stats) == counts(want_stats), f"prompt {i}"
    assert sum(r.stats.accepted for r in requests) > 0


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (1.0, 0.8)])
def test_batched_sampling_gives_each_row_the_target_distribution(tiny_vocab_pair, temp, top_p):
    """Two prompts in turn, 400 rows a batch, 8 batches: each prompt's first tokens pass a chi-square
    test (false-alarm rate 0.1% per prompt) against the target's exact distribution."""
    (target, hf_target), (draft, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    prompts = [[5, 3, 6, 1], [2, 7, 7, 4, 6, 1]]
    batch = [prompts[i % 2] for i in range(400)]
    mx.random.seed(99)
    counts_ = np.zeros((2, 8))
    models, settings = Models(target, draft), Settings(max_tokens=4, temp=temp, top_p=top_p, num_draft=3)
    pooled = Stats()
    for _ in range(8):
        requests = requests_for(batch, settings)
        tokens, _ = decode_batch(models, requests, len(batch))
        for i in range(len(batch)):
            counts_[i % 2, tokens[i][0] if tokens[i] else 1] += 1
        pooled = sum((r.stats for r in requests), pooled)
    assert 0.1 < pooled.acceptance_rate < 0.9, "the draft must be rejected sometimes for this to test anything"
    for which, prompt in enumerate(prompts):
        expected = exact_first_token_distribution(hf_target, prompt, temp, top_p)
        assert chi_square_passes(counts_[which], expected), (which, counts_[which] / counts_[which].sum(), expected)


@pytest.mark.parametrize("drafting", [dict(num_draft=3), dict(num_draft="auto"), dict(num_draft=2, prompt_lookup=True),
                                      dict(num_draft=2, repetition_penalty=2.0, no_repeat_ngram_size=2),
                                      dict(speculative=False)])
def test_a_seeded_row_samples_alone_as_among_others(tiny_vocab_pair, drafting):
    """A sampled row with a seed draws the same tokens decoded alone and among rows of other seeds and prompts, drafted
    by a model (fixed or auto), looked up, under penalties, or not drafted: what lets the sampling tests draw their
    samples in batches (support.sampled)."""
    (target, _), (draft, _) = tiny_vocab_pair["target"], tiny_vocab_pair["draft"]
    models = Models(target, None if drafting.get("prompt_lookup") or drafting.get("speculative") is False else draft)
    prompts = [[5, 3, 6, 1], [0, 3, 5, 4, 3, 4, 0, 7, 1], [2, 7, 7, 4, 6, 1]]
    settings = [Settings(max_tokens=12, temp=1.0, top_p=0.9 if seed % 2 else 1.0, seed=seed, **drafting) for seed in range(9)]
    alone = [decode(models, prompts[i % 3], row) for i, row in enumerate(settings)]
    together, _ = decode_batch(models, [Request(prompts[i % 3], row) for i, row in enumerate(settings)], 9)
    assert together == alone and len({tuple(tokens) for tokens in alone}) > 3


def storage_seen(models: Models, requests: list[Request], batch_size: int) -> list[tuple[int, int, int, int]]:
    """Decode the requests; after each target step, its first layer's (rows, storage length, longest row, rows' count)."""
    seen, original = [], models.target.decode

    def recording(tokens, cache):
        out = original(tokens, cache)
        layer = cache.self_attention[0]
        seen.append((layer.keys.shape[0], layer.keys.shape[2], max(layer.offsets), len(layer.offsets)))
        return out

    models.target.decode = recording
    try:
        decode_batch(models, requests, batch_size)
    finally:
        del models.target.decode
    return seen


def test_cache_storage_follows_the_longest_row_never_the_rejected_drafts(pair, prompts):
    """With a draft that is nearly always rejected, each layer's storage stays at the
    block-rounded length of the longest row (plus one verify pass), for the rows in the batch."""
    target, draft = pair["target"], pair["drafts"]["unrelated"]
    requests = requests_for(prompts, Settings(max_tokens=300, num_draft=8))
    seen = storage_seen(Models(target, draft), requests, 4)
    accepted, drafted = sum(r.stats.accepted for r in requests), sum(r.stats.drafted for r in requests)
    assert drafted > 5 * accepted, "the drafts must be mostly rejected"
    for rows, capacity, longest, offsets in seen:
        assert rows == offsets <= 4
        assert capacity == -(-longest // KVCache.block) * KVCache.block


def test_cache_storage_shrinks_when_the_longest_row_leaves(pair, prompts):
    """A long row's storage leaves with it: the short rows decoded after it
    read storage of their own length, not the long row's (KVCache.keep,
    which every kind of batch calls as rows leave; regular rows here)."""
    target, draft = pair["target"], pair["drafts"]["close"]
    short = Settings(max_tokens=8, ignore_eos=True, speculative=False)
    requests = [Request(prompts[0], replace(short, max_tokens=150))] + [Request(p, short) for p in prompts * 3]
    seen = storage_seen(Models(target, draft), requests, 2)
    assert max(capacity for _, capacity, _, _ in seen) >= 150 and seen[-1][1] == KVCache.block, "the long row must leave first"
    for rows, capacity, longest, offsets in seen:
        assert rows == offsets <= 2
        assert capacity == -(-longest // KVCache.block) * KVCache.block


def test_kv_cache_rows_append_and_trim_at_their_own_lengths():
    cache = KVCache(rows=3)
    append(cache, mx.zeros((3, 2, 4, 1)))
    cache.trim([0, 2, 3])
    append(cache, mx.array([1.0, 2.0, 3.0]).reshape(3, 1, 1, 1) * mx.ones((3, 2, 2, 1)))
    assert cache.offsets == [6, 4, 3]
    assert np.array(cache.keys[:, 0, :6, 0]).tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 2, 2, 0, 0], [0, 3, 3, 0, 0, 0]]
    cache.keep([2, 0])
    assert cache.offsets == [3, 6] and np.array(cache.keys[:, 0, :6, 0]).tolist()[0] == [0, 3, 3, 0, 0, 0]


# ---------------------------------------------------------------- the API and the command line


@pytest.fixture(scope="module")
def models(pair):
    checkpoint = pair["checkpoint"]
    return Models(pair["target"], pair["drafts"]["close"], load_tokenizer(checkpoint.mlx_dir), checkpoint.mlx_dir)


def test_batch_generate_returns_each_prompts_own_generation_in_input_order(models):
    texts = PROMPTS + ["a", "def f(x): return x"]
    generations = batch_generate(models, texts, batch_size=3, max_tokens=16, num_draft=3)
    assert len(generations) == len(texts)
    for text, generation in zip(texts, generations):
        responses = list(stream_generate(models, text, max_tokens=16, num_draft=3))
        assert generation.text == generate(models, text, max_tokens=16, num_draft=3)
        assert generation.tokens == [r.token for r in responses if r.token is not None]
        assert generation.finish_reason == responses[-1].finish_reason
        assert counts(generation.stats) == counts(responses[-1].stats)


def test_a_seed_makes_a_sampled_batch_reproducible(models, unit_scale_pair):
    models = Models(*unit_scale_pair, models.tokenizer, models.target_path)  # spread-out distributions
    options = dict(batch_size=4, max_tokens=12, temp=1.0, num_draft=3)
    first = batch_generate(models, PROMPTS, seed=7, **options)
    assert [g.tokens for g in first] == [g.tokens for g in batch_generate(models, PROMPTS, seed=7, **options)]
    assert [g.tokens for g in first] != [g.tokens for g in batch_generate(models, PROMPTS, seed=8, **options)]


@pytest.mark.parametrize("call, message", [
    (lambda m: batch_generate(m, ["a", " ", "b"]), "prompt 2 of 3 is empty"),
    (lambda m: batch_generate(m, []), "prompts must be a non-empty list"),
    (lambda m: batch_generate(m, ["a"], batch_size=0), "batch_size must be an integer >= 1"),
    (lambda m: batch_generate(m, ["a"], num_draft=0), "num_draft must be an integer in \\[1, 64\\]"),
])
def test_bad_batch_input_is_refused_before_decoding(models, call, message):
    with pytest.raises(ValueError, match=message):
        call(models)


def model_flags(pair) -> list[str]:
    return ["--model", str(pair["checkpoint"].mlx_dir), "--draft-model", str(pair["checkpoint"].mlx_dir)]


@pytest.mark.parametrize("extra", [[], ["--regular-decode"], ["--batch-size", "2"]])
def test_cli_prompts_file_prints_one_json_line_per_prompt_as_run_alone(pair, tmp_path, capsys, extra):
    """A record a line of the file, in order, each naming its line and prompt; a blank line's says it was skipped."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:4]) + "\n\n   \n" + PROMPTS[4] + "\n")
    assert main.main(model_flags(pair) + ["--prompts-file", str(path), "--json", "--max-tokens", "10", *extra]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["line"], r["prompt"]) for r in records] == [(1, PROMPTS[0]), (2, PROMPTS[1]), (3, PROMPTS[2]), (4, PROMPTS[3]),
                                                           (5, ""), (6, ""), (7, PROMPTS[4])]
    assert records[4] == {"line": 5, "prompt": "", "skipped": "blank line"} and records[5]["skipped"] == "blank line"
    lines = [json.dumps(r) for r in records if "skipped" not in r]
    for prompt, line in zip(PROMPTS, lines):
        alone = ["--regular-decode"] if "--regular-decode" in extra else []
        assert main.main(model_flags(pair) + ["--prompt", prompt, "--json", "--max-tokens", "10", *alone]) == 0
        single = json.loads(capsys.readouterr().out)
        batched = json.loads(line)
        assert batched["text"] == single["text"] and batched["tokens"] == single["tokens"]
        assert {k: v for k, v in batched["stats"].items() if "second" not in k} == \
               {k: v for k, v in single["stats"].items() if "second" not in k}


def test_cli_prompts_file_text_shows_each_prompt_in_order_then_the_total(pair, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:3]) + "\n")
    assert main.main(model_flags(pair) + ["--prompts-file", str(path), "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("--- ")]
    assert headers[:3] == ["--- prompt 1 of 3", "--- prompt 2 of 3", "--- prompt 3 of 3"]
    assert headers[3].startswith("--- 3 prompts: 18 tokens in") and out.count("Accepted") == 3


@pytest.mark.parametrize("content, argv, message", [
    (b"", [], "has no prompts"),
    (b"\n  \n\t\n", [], "has no prompts"),
    (b"fine\n\xff\xfe bad\n", [], "line 2: not valid UTF-8"),
    (b"fine\n", ["--batch-size", "0"], "--batch-size must be an integer >= 1 (got 0)"),
    (None, ["--batch-size", "4"], "--batch-size goes with --prompts-file"),
    (b"fine\n", ["--prompt", "x"], "give --prompt or --prompts-file, not both"),
    (b"fine\n", ["--interactive"], "--prompts-file goes with a one-shot run or --sweep"),
])
def test_bad_batch_input_gives_one_line_error_before_loading(pair, tmp_path, capsys, content, argv, message):
    flags = list(argv)
    if content is not None:
        path = tmp_path / "prompts.txt"
        path.write_bytes(content)
        flags += ["--prompts-file", str(path)]
    assert main.main(model_flags(pair) + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert "Loading" not in err


def test_sweep_with_a_batch_size_times_batched_runs(pair, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:3]) + "\n")
    assert main.main(model_flags(pair) + ["--sweep", "--num-drafts", "1,4", "--deltas", "0", "--prompts-file", str(path),
                                          "--batch-size", "3", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "3 prompts in batches of 3" in out
    assert len([line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]) == 2


def test_rows_with_their_own_settings_each_decode_as_they_would_alone(pair, prompts):
    """One batch, each row with its own max_tokens, num_draft, delta, temperature,
    top-k, top-p and seed (as the server's requests have): each row's tokens
    and counts are those of its request decoded alone; greedy rows at delta 0
    are regular greedy decoding's."""
    target, draft = pair["target"], pair["drafts"]["close"]
    settings = [Settings(max_tokens=20, num_draft=3), Settings(max_tokens=12, num_draft=1, delta=0.6),
                Settings(max_tokens=25, num_draft=4, temp=1.0, seed=5),
                Settings(max_tokens=18, num_draft=2, temp=0.7, top_k=5, top_p=0.9, seed=9, delta=0.2),
                Settings(max_tokens=9, num_draft=5)]
    chosen = [prompts[i] for i in (0, 3, 5, 6, 8)]
    models = Models(target, draft)
    together_requests = [Request(p, s) for p, s in zip(chosen, settings)]
    together, _ = decode_batch(models, together_requests, 8)
    for i, (prompt, options) in enumerate(zip(chosen, settings)):
        alone_request = Request(prompt, options)
        assert decode_batch(models, [alone_request], 8)[0] == [together[i]], f"row {i}"
        assert counts(alone_request.stats) == counts(together_requests[i].stats), f"row {i}"
    for i in (0, 4):
        assert together[i] == regular(target, chosen[i], settings[i].max_tokens)


def test_a_source_of_features_decodes_as_its_token_ids_alone_and_padded_in_a_batch(v1_1_checkpoint, tmp_path):
    """A request's source may be features, (frames, F), which the family's
    input layer reads (EncoderDecoder.source_input). With one-hot features
    read through the embedding's table, each prompt decodes to what its ids
    give, regular and drafted, alone and beside features of other lengths
    (padded with zeros and masked)."""
    from loading import load_model

    def listening(folder):  # a model whose input layer takes features: one-hot rows times the embedding's table
        model = load_model(folder)
        model.source_input = lambda features: features @ model.shared.weight
        return model

    target, draft = listening(v1_1_checkpoint.mlx_dir), listening(v1_1_checkpoint.mlx_dir)
    tokenizer = load_tokenizer(v1_1_checkpoint.mlx_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS[:3]]
    assert len({len(p) for p in prompts}) == 3, "the sources must differ in length for padding to matter"
    vocabulary = target.args.vocab_size
    features = [mx.array(np.eye(vocabulary, dtype=np.float32)[prompt]) for prompt in prompts]
    reading_ids = Models(load_model(v1_1_checkpoint.mlx_dir), load_model(v1_1_checkpoint.mlx_dir))
    for models, settings in ((Models(target), Settings(max_tokens=16, speculative=False)),
                             (Models(target, draft), Settings(max_tokens=16, num_draft=3))):
        expected = [decode(reading_ids, prompt, settings) for prompt in prompts]
        assert len(set(expected[0])) >= 5, "the output must vary for this to test anything"
        assert [decode(models, source, settings) for source in features] == expected
        together, _ = decode_batch(models, [Request(source, settings) for source in features], 3)
        assert together == expected


@pytest.fixture(scope="module")
def unit_v1_1(tmp_path_factory, tokenizer_dir, tokenizer):
    """v1.1 at initializer_factor 1: logits of order one, which a logit bias of 100 outweighs."""
    from conftest import build
    from loading import load_model

    checkpoint = build("v1_1_gated_untied", tmp_path_factory, tokenizer_dir, tokenizer, initializer_factor=1.0)
    return checkpoint, {"target": load_model(checkpoint.mlx_dir), "drafts": {"close": load_model(checkpoint.mlx_dir)}}


@pytest.mark.parametrize("options", [{}, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
                                     {"min_tokens": 6, "logit_bias": {1: 100.0}}])
def test_a_decoder_opening_of_several_tokens_continues_as_transformers_continues_it(v1_1_checkpoint, pair, unit_v1_1,
                                                                                     options):
    """A row's decoder may open with several tokens (as Whisper's start,
    language and task do): each row continues its own opening as
    transformers' generate continues decoder_input_ids (the opening counted
    as seen by the penalties, not as output by min_tokens), regular,
    drafted, looked up and in beams, with openings of different lengths in
    one batch."""
    import torch

    from options import Opening

    if "min_tokens" in options:  # the end of text made likeliest, min_tokens holding it back
        v1_1_checkpoint, pair = unit_v1_1
    hf_model, prompt = v1_1_checkpoint.hf_model, v1_1_checkpoint.prompt_ids
    openings = [(0,), (0, 17, 300), (0, 41, 99, 7, 250)]

    def theirs(opening, **more):
        names = {"min_tokens": "min_new_tokens", "logit_bias": "sequence_bias"}
        named = {names.get(name, name): value for name, value in options.items()}
        if "sequence_bias" in named:
            named["sequence_bias"] = {(token,): bias for token, bias in named["sequence_bias"].items()}
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), decoder_input_ids=torch.tensor([list(opening)]),
                                    max_new_tokens=16, do_sample=False, **({"num_beams": 1} | named | more))
        return [token for token in out[0, len(opening):].tolist() if token != 1]

    expected = [theirs(opening) for opening in openings]
    if "min_tokens" in options:
        assert {len(tokens) for tokens in expected} == {6}, "the end of text must come as soon as min_tokens lets it"
    else:
        assert len({tuple(tokens) for tokens in expected}) == 3, "each opening must steer the output"
    target = pair["target"]
    for models, settings in ((Models(target), Settings(max_tokens=16, speculative=False, **options)),
                             (Models(target, pair["drafts"]["close"]), Settings(max_tokens=16, num_draft=3, **options)),
                             (Models(target), Settings(max_tokens=16, num_draft=3, prompt_lookup=True, **options))):
        requests = [Request(prompt, settings, opening=Opening(opening)) for opening in openings]
        assert decode_batch(models, requests, 3)[0] == expected, settings
    beams = Settings(max_tokens=16, num_beams=3, speculative=False, **options)
    requests = [Request(prompt, beams, opening=Opening(opening)) for opening in openings]
    assert decode_batch(Models(target), requests, 3)[0] == [theirs(opening, num_beams=3) for opening in openings]
