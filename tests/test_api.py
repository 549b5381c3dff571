"""The Python API: loading.load, generate.generate and stream_generate, and their errors."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import main
from errors import OptionError
from generate import batch_generate, generate, stream_generate
from text import Detokenizer
from loading import load, load_tokenizer
from options import Settings

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"


@pytest.fixture(scope="module")
def demo_pair():
    return load(DEMO / "target", draft=DEMO / "draft")


@pytest.fixture(scope="module")
def demo_prompts():
    return main.demo_prompts()


@pytest.mark.parametrize("options, flags", [
    (dict(), []),
    (dict(num_draft=3, delta=0.5), ["--num-draft", "3", "--delta", "0.5"]),
    (dict(speculative=False), ["--regular-decode"]),
    (dict(temp=0.8, top_p=0.9, seed=7), ["--temp", "0.8", "--top-p", "0.9", "--seed", "7"]),
])
def test_streamed_pieces_join_to_generate_text_and_the_cli_json_text(demo_pair, demo_prompts, capsys, options, flags):
    prompt = demo_prompts[2]
    responses = list(stream_generate(demo_pair, prompt, **options))
    *steps, last = responses
    assert all(r.token is not None for r in steps) and last.token is None and last.finish_reason == "stop"
    assert (last.stats.draft_calls == 0) == (options.get("speculative") is False)
    assert [r.stats.generated for r in steps] == list(range(1, len(steps) + 1))  # each its own snapshot
    text = "".join(r.text for r in responses)
    assert text == generate(demo_pair, prompt, **options)
    assert text == demo_pair.tokenizer.decode([r.token for r in steps])
    # The CLI's defaults differ from the library's: delta 0.1, and num-draft 3 with --demo.
    assert main.main(["--demo", "--delta", "0", "--num-draft", "5", *flags, "--prompt", prompt, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == text and result["tokens"] == [r.token for r in steps]


def test_the_last_response_says_length_when_max_tokens_stops_it(demo_pair, demo_prompts):
    responses = list(stream_generate(demo_pair, demo_prompts[0], max_tokens=5))
    assert len(responses) == 6 and responses[-1].finish_reason == "length" and responses[-1].stats.generated == 5


def test_without_a_draft_generation_is_the_targets_own(demo_prompts):
    alone = load(DEMO / "target")
    assert alone.draft is None
    responses = list(stream_generate(alone, demo_prompts[1]))
    assert responses[-1].stats.drafted == 0
    assert "".join(r.text for r in responses) == generate(load(DEMO / "target", draft=DEMO / "draft"), demo_prompts[1])


def test_stop_strings_end_the_text_before_them_in_every_api(demo_pair, demo_prompts):
    """generate, stream_generate and batch_generate share the server's text
    stream: the text ends before the first stop string, finish_reason
    "stop", and a batch's tokens are those whose text was given."""
    prompt = demo_prompts[0]
    full = generate(demo_pair, prompt, max_tokens=30)
    # a stop string at a token's start ("Gre", after "self.assert") and inside tokens
    for stop in ["Gre"] + [full[i : i + 3] for i in range(14, len(full) - 3, 5)]:
        responses = list(stream_generate(demo_pair, prompt, max_tokens=30, stop=[stop]))
        text = full[: full.index(stop)]
        assert "".join(r.text for r in responses) == text == generate(demo_pair, prompt, max_tokens=30, stop=stop)
        assert responses[-1].finish_reason == "stop"
        (generation,) = batch_generate(demo_pair, [prompt], max_tokens=30, stop=[stop])
        assert generation.text == text and generation.finish_reason == "stop"
        assert generation.tokens == [r.token for r in responses if r.token is not None], stop
        assert demo_pair.tokenizer.decode(generation.tokens).startswith(text)


def test_settings_pass_whole_with_keywords_over_them(demo_pair, demo_prompts):
    settings = Settings(max_tokens=7, num_draft=2, delta=0.3)
    assert generate(demo_pair, demo_prompts[1], settings=settings) == generate(demo_pair, demo_prompts[1], max_tokens=7,
                                                                              num_draft=2, delta=0.3)
    responses = list(stream_generate(demo_pair, demo_prompts[1], settings=settings, max_tokens=3))
    assert responses[-1].stats.generated == 3 and responses[-1].finish_reason == "length"
    with pytest.raises(TypeError, match="settings must be an options.Settings"):
        generate(demo_pair, "x", settings={"max_tokens": 3})


@pytest.mark.parametrize("clean_up_spaces", [False, True])
def test_detokenizer_equals_decoding_everything_at_once_for_any_token_sequence(clean_up_spaces):
    """Random ids, special tokens, sentinels and punctuation included, streamed
    one at a time. A tokenizer configured to remove spaces before punctuation
    (transformers 4's default) must be decoded without that, as a stream
    cannot take back a space it has shown: with clean_up_spaces the tokenizer's
    own default would disagree with the reference on some sequences."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO / "target"))  # transformers': it has the clean-up setting
    tokenizer.clean_up_tokenization_spaces = clean_up_spaces
    punctuation = [i for i in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(i) in (".", "▁", ",", "?", "'", "n", "s")]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(punctuation) if rng.random() < 0.4 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(1, 40))]
        detokenizer = Detokenizer(tokenizer)
        text = "".join(detokenizer.add(token) for token in ids) + detokenizer.flush()
        assert text == tokenizer.decode(ids, clean_up_tokenization_spaces=False), ids


def test_the_tokenizer_encodes_and_decodes_as_transformers_does():
    """load_tokenizer reads tokenizer.json with the tokenizers library (no
    PyTorch at start-up); ids and text must be transformers' own."""
    ours, theirs = load_tokenizer(DEMO / "target"), AutoTokenizer.from_pretrained(str(DEMO / "target"))
    texts = main.demo_prompts() + ["translate English to French: Let's go, naïve café – 日本!", "  two  spaces\tand a tab", ""]
    for text in texts:
        assert ours.encode(text) == theirs(text).input_ids, text
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 30))]
        assert ours.decode(ids) == theirs.decode(ids, clean_up_tokenization_spaces=False), ids
        assert ours.decode(ids, skip_special_tokens=True) == \
            theirs.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)


def test_a_stream_that_skips_special_tokens_equals_decoding_everything_at_once_without_them():
    """Sentinels, </s> and <pad> among ordinary tokens, as a random model's
    output has them: the streamed text is transformers' skip_special_tokens decoding."""
    tokenizer = load_tokenizer(DEMO / "target")
    special = [tokenizer.encode(token)[0] for token in ("<extra_id_0>", "<extra_id_7>", "<pad>")] + [1]
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.3 else rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
        detokenizer = Detokenizer(tokenizer, skip_special_tokens=True)
        text = "".join(detokenizer.add(token) for token in ids) + detokenizer.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True), ids
        assert "<extra_id" not in text and "</s>" not in text and "<pad>" not in text


def test_detokenizer_holds_back_an_incomplete_character():
    """Byte-fallback tokenizers spell a character over several tokens; until
    the last one comes, the text ends in U+FFFD and nothing is shown."""

    class ByteTokenizer:  # one token per UTF-8 byte
        def decode(self, ids, **options):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("naïve – 日本".encode())
    detokenizer = Detokenizer(ByteTokenizer())
    pieces = [detokenizer.add(token) for token in ids]
    assert "".join(pieces) + detokenizer.flush() == "naïve – 日本"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[ids.index(0xC3)] == "" and pieces[ids.index(0xC3) + 1] == "ï"
    truncated = Detokenizer(ByteTokenizer())
    assert [truncated.add(token) for token in "日".encode()[:2]] == ["", ""]
    assert truncated.flush() == "\ufffd"  # what decoding everything at once gives


def test_detokenizer_work_per_token_does_not_grow_with_the_output(demo_pair):
    """Each token decodes a short window, never the whole prefix."""
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, ids, **options):
            decoded_lengths.append(len(ids))
            return demo_pair.tokenizer.decode(ids, **options)

    ids = demo_pair.tokenizer.encode(" ".join(main.demo_prompts() * 3))
    assert len(ids) > 3000
    detokenizer = Detokenizer(CountingTokenizer())
    text = "".join(detokenizer.add(token) for token in ids) + detokenizer.flush()
    assert text == demo_pair.tokenizer.decode(ids)
    assert max(decoded_lengths) <= 4, max(decoded_lengths)


@pytest.mark.parametrize("options, message", [
    (dict(num_draft=0), "num_draft must be an integer in [1, 64] or auto (got 0)"),
    (dict(delta=-0.1), "delta must be a number in [0, 1]"),
    (dict(temp=float("inf")), "temp must be a number in [0, 100]"),
    (dict(top_p=0), "top_p must be a number in (0, 1]"),
    (dict(max_tokens=2.5), "max_tokens must be an integer in [1, 2**31)"),
    (dict(seed=-1), "seed must be an integer in [0, 2**64)"),
])
def test_options_out_of_range_raise_option_error_naming_the_keyword(demo_pair, options, message):
    with pytest.raises(OptionError) as raised:
        generate(demo_pair, "def f(x): return <extra_id_0>", **options)
    assert str(raised.value).startswith(message) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize("call, message", [
    (lambda m: generate(m, 123), "the prompt must be a string (got int)"),
    (lambda m: stream_generate(m, None), "the prompt must be a string (got NoneType)"),
    (lambda m: batch_generate(m, [1, 2]), "prompts must be a list of strings (prompt 1 is int)"),
    (lambda m: batch_generate(m, "one prompt"), "prompts must be a list of strings (got one string: generate takes one prompt)"),
    (lambda m: batch_generate(m, {"a": 1}), "prompts must be a list of strings (got dict)"),
    (lambda m: generate("demo/target", "x"), "models must be what loading.load returns (got str 'demo/target'): models = load("),
    (lambda m: batch_generate(None, ["x"]), "models must be what loading.load returns (got NoneType)"),
])
def test_arguments_of_the_wrong_type_are_named_in_a_type_error(demo_pair, call, message):
    """Each says what was given and what is wanted (they once all said
    "prompts must be a non-empty list", or raised an AttributeError)."""
    with pytest.raises(TypeError) as raised:
        call(demo_pair)
    assert str(raised.value).startswith(message), str(raised.value)


def test_an_empty_prompt_and_an_unknown_option_are_refused(demo_pair):
    with pytest.raises(OptionError, match="the prompt is empty"):
        generate(demo_pair, "   ")
    with pytest.raises(TypeError):
        generate(demo_pair, "x", num_drafts=3)
    with pytest.raises(TypeError):  # options are keywords only
        load(DEMO / "target", DEMO / "draft")


def readme_api_example() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n", text.index("## Python API")) + len("```python\n")
    return text[start : text.index("```", start)]


def test_the_readme_api_example_runs_from_a_script_outside_the_repository(tmp_path):
    """As the README says to run it from another folder: this one on PYTHONPATH."""
    script = tmp_path / "example.py"
    script.write_text(readme_api_example())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "<extra_id_0>" in done.stdout and "warning" not in done.stderr.lower(), done.stderr


def test_n_outputs_of_a_prompt_share_one_encoding_and_each_is_what_its_seed_gives_alone(demo_pair, demo_prompts,
                                                                                         monkeypatch, capsys):
    encoded_rows = []
    encoding = demo_pair.target.encoding

    def counted(tokens, *args):  # every encoding's work starts here
        encoded_rows.append(len(tokens))
        return (yield from encoding(tokens, *args))

    monkeypatch.setattr(demo_pair.target, "encoding", counted)
    options = dict(temp=1.0, seed=5, max_tokens=12, speculative=False)
    generations = batch_generate(demo_pair, demo_prompts[:2], n=3, batch_size=6, **options)
    assert encoded_rows == [2]  # six rows, two prompts encoded
    monkeypatch.undo()
    texts = [g.text for g in generations]
    for j in range(3):
        assert texts[j] == generate(demo_pair, demo_prompts[0], **{**options, "seed": 5 + j})
        assert texts[3 + j] == generate(demo_pair, demo_prompts[1], **{**options, "seed": 5 + j})
    assert len(set(texts[:3])) > 1
    with pytest.raises(OptionError, match="batch_generate gives n"):
        generate(demo_pair, demo_prompts[0], n=2)
    assert main.main(["--demo", "--json", "--n", "3", "--temp", "1", "--seed", "5", "--max-tokens", "12",
                      "--regular-decode", "--prompt", demo_prompts[0]]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == texts[:3]
    assert main.main(["--demo", "--compare", "--n", "2"]) == 2
