"""OpenAI's response shapes, as the server writes them: the fields OpenAI's clients read, in their places."""

import openai.types as types

from options import Stats
from serving import shapes

STATS = Stats(prompt_tokens=5, generated=7, target_calls=3, drafted=8, accepted=6, seconds=0.5, encoding_seconds=0.1)


def test_a_completion_parses_as_openais_completion_and_chat_completion():
    used = shapes.usage(5, 7)
    assert used == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    text = shapes.completion("cmpl-1", 10, "t5", False, [("Hallo", "stop", None), ("Welt", "length", None)], used, STATS)
    parsed = types.Completion.model_validate(text)
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [(0, "Hallo", "stop"), (1, "Welt", "length")]
    assert parsed.object == "text_completion" and parsed.usage.total_tokens == 12
    chat = types.chat.ChatCompletion.model_validate(
        shapes.completion("chatcmpl-1", 10, "t5", True, [("Hi", "stop", None)], used, STATS))
    assert chat.choices[0].message.content == "Hi" and chat.choices[0].message.role == "assistant"
    assert text["speculative"] == {"drafted": 8, "accepted": 6, "acceptance_rate": 0.75, "drafts_per_round": 2.667,
                                   "target_calls": 3, "tokens_per_second": 17.5, "encoding_seconds": 0.1}


def test_logprobs_parse_as_openais_completion_and_chat_logprobs():
    tokens = [("Hal", -0.5, [("Hal", -0.5), ("Hel", -1.5)]), ("lo", -0.1, [("lo", -0.1), ("la", -3.0)])]
    legacy = shapes.logprobs(False, tokens, [0, 3])
    parsed = types.Completion.model_validate(shapes.completion("cmpl-1", 10, "t5", False, [("Hallo", "stop", legacy)],
                                                                shapes.usage(1, 2), STATS))
    given = parsed.choices[0].logprobs
    assert given.tokens == ["Hal", "lo"] and given.token_logprobs == [-0.5, -0.1] and given.text_offset == [0, 3]
    assert given.top_logprobs[0] == {"Hal": -0.5, "Hel": -1.5}
    chat = types.chat.ChatCompletion.model_validate(shapes.completion(
        "chatcmpl-1", 10, "t5", True, [("Hallo", "stop", shapes.logprobs(True, tokens, [0, 3]))], shapes.usage(1, 2), STATS))
    content = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob, bytes(t.bytes)) for t in content] == [("Hal", -0.5, b"Hal"), ("lo", -0.1, b"lo")]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("lo", -0.1), ("la", -3.0)]


def test_chunks_parse_as_openais_chunks_and_only_the_last_carries_the_statistics():
    first = shapes.chunk("chatcmpl-1", 10, "t5", True, 0, None, None, first=True)
    piece = shapes.chunk("chatcmpl-1", 10, "t5", True, 0, "Hal", None)
    last = shapes.chunk("chatcmpl-1", 10, "t5", True, 0, "lo", "stop", stats=STATS)
    parsed = [types.chat.ChatCompletionChunk.model_validate(c) for c in (first, piece, last)]
    assert [p.choices[0].delta.role for p in parsed] == ["assistant", None, None]
    assert [p.choices[0].delta.content for p in parsed] == [None, "Hal", "lo"]
    assert "speculative" in last and "speculative" not in piece
    completion = types.Completion.model_validate(shapes.chunk("cmpl-1", 10, "t5", False, 1, "x", "length"))
    assert completion.choices[0].index == 1 and completion.choices[0].text == "x"
    # OpenAI's own completion chunks carry finish_reason null until the last (its type admits only the last)
    assert shapes.chunk("cmpl-1", 10, "t5", False, 1, "x", None)["choices"][0]["finish_reason"] is None
    usage = types.chat.ChatCompletionChunk.model_validate(shapes.usage_chunk("chatcmpl-1", 10, "t5", True, shapes.usage(1, 2)))
    assert usage.choices == [] and usage.usage.completion_tokens == 2


def test_an_error_has_openais_four_fields():
    assert shapes.error_body("no", "invalid_request_error", param="model") == \
        {"error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": None}}
