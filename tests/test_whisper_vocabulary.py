"""Whisper's real vocabulary, as openai-whisper ships it (mlx-whisper's wheel carries its multilingual.tiktoken):
a tokenizer.json made of it by transformers' converter reads and writes text as openai-whisper's tokenizer does, the
language names and tokens are openai-whisper's, and a segment's words are those transformers' pipeline makes of
the same tokens, in languages with and without spaces."""

import importlib.util
import random
from pathlib import Path

import pytest

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


def reference():
    """openai-whisper's tokenizer module (mlx-whisper's copy), loaded alone: the package itself imports numba."""
    spec = importlib.util.find_spec("mlx_whisper")
    if spec is None or importlib.util.find_spec("tiktoken") is None:
        pytest.skip("mlx-whisper and tiktoken (CI installs them) bring openai-whisper's vocabulary")
    root = Path(spec.submodule_search_locations[0])
    module_spec = importlib.util.spec_from_file_location("openai_whisper_tokenizer", root / "tokenizer.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module, root / "assets" / "multilingual.tiktoken"


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    """openai-whisper's multilingual tokenizer (99 languages, as large-v2's) and ours, loaded from the tokenizer.json
    transformers' converter makes of the same file, with the special tokens in Whisper's order."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    module, ranks = reference()
    theirs = module.get_tokenizer(multilingual=True, num_languages=99)
    specials = sorted(theirs.encoding._special_tokens.items(), key=lambda item: item[1])
    converted = TikTokenConverter(vocab_file=str(ranks), pattern=theirs.encoding._pat_str).converted()
    converted.add_special_tokens([AddedToken(token, special=True) for token, _ in specials])
    folder = tmp_path_factory.mktemp("vocabulary")
    converted.save(str(folder / "tokenizer.json"))
    return module, theirs, load_tokenizer(folder), folder


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
    """Words (their text, and which tokens each spans) equal transformers' pipeline's
    (`_combine_tokens_into_words`, openai-whisper's rules): a sentence in each language, and 200 runs of random tokens,
    which split characters between tokens and put marks anywhere."""
    from transformers import WhisperTokenizerFast
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    module, theirs, ours, folder = vocabulary
    transformers_tokenizer = WhisperTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    name = module.LANGUAGES[language]
    rng = random.Random(language)
    runs = [theirs.encode(TEXTS[language])] + [[rng.randrange(50257) for _ in range(rng.randint(1, 16))] for _ in range(200)]
    for tokens in runs:
        words, _, indices = _combine_tokens_into_words(transformers_tokenizer, tokens, name, "\"'“¿([{-",
                                                       "\"'.。,，!！?？:：”)]}、")
        expected = [(word.strip(), span[0], span[-1] + 1) for word, span in zip(words, indices) if word.strip()]
        found = words_of(tokens, list(range(len(tokens) + 1)), ours, end=50257, spaceless=language in SPACELESS)
        assert [(word["word"], word["start"], word["end"]) for word in found] == expected, tokens
