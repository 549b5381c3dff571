"""OpenAI's response shapes, as the server writes them: the fields OpenAI's clients read, in their places."""

import openai.types as types

from options import Stats
from serving import shapes

STATS = Stats(prompt_tokens=5, generated=7, target_calls=3, drafted=8, accepted=6, seconds=0.5, encoding_seconds=0.1)


def test_a_completion_parses_as_openais_completion_and_chat_completion():
    used = shapes.usage(5, 7)
    assert used == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    text = shapes.COMPLETIONS.completion("cmpl-1", 10, "t5", [("Hallo", "stop", None), ("Welt", "length", None)], used, STATS)
    parsed = types.Completion.model_validate(text)
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [(0, "Hallo", "stop"), (1, "Welt", "length")]
    assert parsed.object == "text_completion" and parsed.usage.total_tokens == 12
    chat = types.chat.ChatCompletion.model_validate(
        shapes.CHAT.completion("chatcmpl-1", 10, "t5", [("Hi", "stop", None)], used, STATS))
    assert chat.choices[0].message.content == "Hi" and chat.choices[0].message.role == "assistant"
    assert text["speculative"] == {"drafted": 8, "accepted": 6, "acceptance_rate": 0.75, "drafts_per_round": 2.667,
                                   "target_calls": 3, "tokens_per_second": 17.5, "encoding_seconds": 0.1}


def test_logprobs_parse_as_openais_completion_and_chat_logprobs():
    tokens = [("Hal", -0.5, [("Hal", -0.5), ("Hel", -1.5)]), ("lo", -0.1, [("lo", -0.1), ("la", -3.0)])]
    legacy = shapes.COMPLETIONS.logprobs(tokens, [0, 3])
    parsed = types.Completion.model_validate(shapes.COMPLETIONS.completion("cmpl-1", 10, "t5", [("Hallo", "stop", legacy)],
                                                                            shapes.usage(1, 2), STATS))
    given = parsed.choices[0].logprobs
    assert given.tokens == ["Hal", "lo"] and given.token_logprobs == [-0.5, -0.1] and given.text_offset == [0, 3]
    assert given.top_logprobs[0] == {"Hal": -0.5, "Hel": -1.5}
    chat = types.chat.ChatCompletion.model_validate(shapes.CHAT.completion(
        "chatcmpl-1", 10, "t5", [("Hallo", "stop", shapes.CHAT.logprobs(tokens, [0, 3]))], shapes.usage(1, 2), STATS))
    content = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob, bytes(t.bytes)) for t in content] == [("Hal", -0.5, b"Hal"), ("lo", -0.1, b"lo")]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("lo", -0.1), ("la", -3.0)]


def test_chunks_parse_as_openais_chunks_and_only_the_last_carries_the_statistics():
    chat, completions = shapes.CHAT, shapes.COMPLETIONS
    first = chat.chunk("chatcmpl-1", 10, "t5", chat.opening(0))
    piece = chat.chunk("chatcmpl-1", 10, "t5", chat.piece(0, "Hal", None, None))
    last = chat.chunk("chatcmpl-1", 10, "t5", chat.piece(0, "lo", "stop", None), stats=STATS)
    parsed = [types.chat.ChatCompletionChunk.model_validate(c) for c in (first, piece, last)]
    assert [p.choices[0].delta.role for p in parsed] == ["assistant", None, None]
    assert [p.choices[0].delta.content for p in parsed] == [None, "Hal", "lo"]
    assert "speculative" in last and "speculative" not in piece
    assert completions.opening(0) is None  # the completions endpoint opens with its first piece
    completion = types.Completion.model_validate(completions.chunk("cmpl-1", 10, "t5", completions.piece(1, "x", "length", None)))
    assert completion.choices[0].index == 1 and completion.choices[0].text == "x"
    # OpenAI's own completion chunks carry finish_reason null until the last (its type admits only the last)
    assert completions.chunk("cmpl-1", 10, "t5", completions.piece(1, "x", None, None))["choices"][0]["finish_reason"] is None
    usage = types.chat.ChatCompletionChunk.model_validate(chat.usage_chunk("chatcmpl-1", 10, "t5", shapes.usage(1, 2)))
    assert usage.choices == [] and usage.usage.completion_tokens == 2


def test_an_error_has_openais_four_fields():
    assert shapes.error_body("no", "invalid_request_error", param="model") == \
        {"error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": None}}
