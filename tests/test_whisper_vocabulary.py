"""Whisper's real vocabulary, as openai-whisper ships it (mlx-whisper's wheel carries its multilingual.tiktoken):
a tokenizer.json made of it by transformers' converter reads and writes text as openai-whisper's tokenizer does, the
language names and tokens are openai-whisper's, and a segment's words are those transformers' pipeline makes of
the same tokens, in languages with and without spaces."""

import random

import pytest

from checkpoints import openai_whisper_tokenizer, save_whisper_vocabulary
from loading import Models, load_tokenizer
from speech_tokens import LANGUAGE_NAMES, SPACELESS, Whisper, words_of

TEXTS = {  # language -> what is said
    "en": " He said, \"Hello (there)!\" - it's 3.5 times faster; isn't it?",
    "fr": " « Ça va ? » Oui, l'été dernier à Paris.",
    "de": " Grüße aus Köln, sagte Jürgen: „Straße!“",
    "ru": " Привет, как дела? Всё хорошо.",
    "ja": " こんにちは世界、元気ですか。「はい」",
    "zh": " 你好，世界！我们今天去公园吧。",
    "th": " สวัสดีครับ วันนี้อากาศดี",
    "ko": " 안녕하세요, 반갑습니다.",
}


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    """openai-whisper's tokenizer module and multilingual tokenizer (99 languages, as large-v2's), and ours, loaded
    from the tokenizer.json transformers' converter makes of the same file."""
    found = openai_whisper_tokenizer()
    if found is None:
        pytest.skip("mlx-whisper and tiktoken (CI installs them) bring openai-whisper's vocabulary")
    folder = tmp_path_factory.mktemp("vocabulary")
    theirs = save_whisper_vocabulary(folder)
    return found[0], theirs, load_tokenizer(folder), folder


def test_the_converted_vocabulary_reads_and_writes_text_as_openai_whispers(vocabulary):
    _, theirs, ours, _ = vocabulary
    for text in TEXTS.values():
        ids = theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.decode(ids) == text
    vocabulary = ours.get_vocab()
    assert all(vocabulary[token] == id for token, id in theirs.encoding._special_tokens.items())
    assert vocabulary["<|notimestamps|>"] + 1 == vocabulary["<|0.00|>"] == 50364


def test_each_language_of_openai_whisper_is_known_by_its_name_and_its_code(vocabulary):
    module, theirs, _, _ = vocabulary
    languages = {code: theirs.encoding._special_tokens[f"<|{code}|>"] for code in module.LANGUAGES if code != "yue"}
    rules = Whisper.of(Models(_Shapes(), generation={"lang_to_id": {f"<|{code}|>": id for code, id in languages.items()},
                                                "is_multilingual": True}))
    for code, name in module.LANGUAGES.items():
        assert LANGUAGE_NAMES[name] == code
        if code in languages:
            assert rules.language_token(name) == rules.language_token(code) == languages[code]
    for alias, code in module.TO_LANGUAGE_CODE.items():
        assert LANGUAGE_NAMES[alias] == code


class _Shapes:
    """A Whisper's shapes, all that Whisper.of reads of a target."""

    class args:
        num_mel_bins, decoder_start_token_id, eos_token_id, vocab_size, max_positions = 80, 50258, 50257, 51865, 448


@pytest.mark.parametrize("language", list(TEXTS))
def test_a_segments_words_are_those_transformers_makes_of_its_tokens(vocabulary, language):
    """Words (their text, and which tokens each spans) equal transformers' pipeline's (`_combine_tokens_into_words`
    at its defaults: openai-whisper's rules and marks, and ¡): a sentence in each language; runs of random tokens,
    which put marks anywhere; and runs of tokens that end or continue a character, which split characters between
    tokens or leave bytes that never make one (one such run ends with a group longer than its text)."""
    from transformers import WhisperTokenizerFast
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    module, theirs, ours, folder = vocabulary
    transformers_tokenizer = WhisperTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    name = module.LANGUAGES[language]
    rng = random.Random(language)
    partial = [token for token in range(50257) if "\ufffd" in ours.decode([token])]
    runs = [theirs.encode(TEXTS[language]), [14279, 121, 135], theirs.encode(" ¡Hola! ¿Qué tal?")]
    runs += [[rng.randrange(50257) for _ in range(rng.randint(1, 16))] for _ in range(200)]
    runs += [[rng.choice(partial) for _ in range(rng.randint(1, 8))] for _ in range(200)]
    for tokens in runs:
        words, _, indices = _combine_tokens_into_words(transformers_tokenizer, tokens, name)
        expected = [(word.strip(), span[0], span[-1] + 1) for word, span in zip(words, indices) if word.strip()]
        found = words_of(tokens, list(range(len(tokens) + 1)), ours, end=50257, spaceless=language in SPACELESS)
        assert [(word["word"], word["start"], word["end"]) for word in found] == expected, tokens
