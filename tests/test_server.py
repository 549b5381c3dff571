"""server.py through a real client (the openai package): completions, chat, streaming, errors, load and shutdown."""

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from checkpoints import PROMPT

from generate import batch_generate, generate, stream_generate
from loading import load
from options import SEEDED_AUTO_DRAFTS
from serving.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
PAIR = ["--model", "demo/target", "--draft-model", "demo/draft"]
EXACT = {"delta": 0, "num_draft": 3}  # greedy (the default temperature) and exact acceptance
TEXT = {"skip_special_tokens": True}  # the server's default (vLLM's), not the API's


class Server(ServerProcess):
    """server.py in a process of its own on a free port of 127.0.0.1, until
    stop(), with an OpenAI client for it."""

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=options.pop("api_key", "unused"), max_retries=0, **options)


@pytest.fixture(scope="module")
def server():
    running = Server(*PAIR, "--max-batch", "8", "--served-model-name", "t5-demo")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def models(demo_models):
    return demo_models


@pytest.fixture(scope="module")
def prompts(demo_prompts):
    return demo_prompts


def test_a_completion_is_generate_on_that_prompt_alone(server, models, prompts):
    reply = server.client().completions.create(model="t5-demo", prompt=prompts[0], max_tokens=30, extra_body=EXACT)
    assert reply.choices[0].text == generate(models, prompts[0], max_tokens=30, **EXACT, **TEXT)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(models.tokenizer.encode(prompts[0]))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens > reply.usage.prompt_tokens
    stats = reply.model_extra["speculative"]
    assert stats["drafted"] > 0 and 0 < stats["acceptance_rate"] <= 1 and stats["drafts_per_round"] > 0


def test_streamed_chunks_join_to_the_same_text_and_end_with_the_reason(server, models, prompts):
    chunks = list(server.client().completions.create(model="t5-demo", prompt=prompts[1], max_tokens=12, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=EXACT))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    responses = list(stream_generate(models, prompts[1], max_tokens=12, **EXACT, **TEXT))
    assert text == "".join(r.text for r in responses)
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [responses[-1].finish_reason]
    assert len([c for c in chunks if c.choices]) > 2 and not chunks[-1].choices  # the usage chunk comes last
    assert chunks[-1].usage.completion_tokens == responses[-1].stats.generated


def test_a_list_of_prompts_gets_a_choice_each_in_order(server, models, prompts):
    reply = server.client().completions.create(model="t5-demo", prompt=prompts[2:5], max_tokens=10, extra_body=EXACT)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [generate(models, p, max_tokens=10, **EXACT, **TEXT) for p in prompts[2:5]]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_maps_the_messages_to_one_prompt(server, models, stream):
    from serving import schema as serving

    messages = [{"role": "system", "content": "Fill in the code."}, {"role": "user", "content": "import <extra_id_0>"}]
    prompt = serving.chat_prompt([serving.Message(**m) for m in messages])
    assert prompt == "Fill in the code.\n\nimport <extra_id_0>"
    reply = server.client().chat.completions.create(model="t5-demo", messages=messages, max_tokens=10, stream=stream,
                                                    extra_body=EXACT)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    else:
        text = reply.choices[0].message.content
        assert reply.choices[0].message.role == "assistant"
    assert text == generate(models, prompt, max_tokens=10, **EXACT, **TEXT)


def test_a_conversation_maps_to_role_lines_ending_with_the_assistants_turn():
    from serving import schema as serving

    messages = [serving.Message(role=r, content=c) for r, c in
                [("user", "Hello"), ("assistant", "Hi."), ("user", "translate English to German: Good morning.")]]
    assert serving.chat_prompt(messages) == \
        "User: Hello\nAssistant: Hi.\nUser: translate English to German: Good morning.\nAssistant:"


def test_a_stop_string_ends_the_text_before_it_and_says_stop(server, models, prompts):
    full = generate(models, prompts[0], max_tokens=30, **EXACT, **TEXT)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    for stream in (False, True):
        reply = server.client().completions.create(model="t5-demo", prompt=prompts[0], max_tokens=30, stop=[stop],
                                                   stream=stream, extra_body=EXACT)
        chunks = list(reply) if stream else [reply]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full[: full.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_usage_counts_the_tokens_whose_text_the_client_received(server, models):
    """Stop " import" on "import <extra_id_0>": the answer is "<extra_id_0>",
    one token, where the round that found the stop string decoded four."""
    (expected,) = batch_generate(models, ["import <extra_id_0>"], max_tokens=30, stop=[" import"], **EXACT)
    assert (expected.text, len(expected.tokens), expected.finish_reason) == ("<extra_id_0>", 1, "stop")
    assert expected.stats.generated > 1
    for stream in (False, True):
        reply = server.client().completions.create(model="t5-demo", prompt="import <extra_id_0>", max_tokens=30,
                                                   stop=[" import"], stream=stream,
                                                   extra_body={**EXACT, "skip_special_tokens": False},
                                                   stream_options={"include_usage": True} if stream else None)
        usage = list(reply)[-1].usage if stream else reply.usage
        assert usage.completion_tokens == 1


def test_32_requests_from_16_threads_each_get_what_generate_gives_alone(server, models, prompts):
    """Temperature 0, delta 0: however requests share batches, each answer is its prompt's own."""
    asked = [(prompts[i % len(prompts)], 8 + (i * 7) % 25) for i in range(32)]
    client = server.client()

    def ask(prompt_and_tokens):
        prompt, tokens = prompt_and_tokens
        return client.completions.create(model="t5-demo", prompt=prompt, max_tokens=tokens, extra_body=EXACT).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, asked))
    assert answers == [generate(models, prompt, max_tokens=tokens, **EXACT, **TEXT) for prompt, tokens in asked]
    assert "completion" in server.output()  # a line per request


def test_seeded_sampling_is_the_same_alone_and_among_other_requests(server, prompts):
    client, options = server.client(), dict(model="t5-demo", max_tokens=20, temperature=1.0, seed=11)
    alone = client.completions.create(prompt=prompts[3], **options).choices[0].text
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(client.completions.create, prompt=p, **{**options, "seed": i}) for i, p in enumerate(prompts[:5])]
        together = pool.submit(client.completions.create, prompt=prompts[3], **options)
        [f.result() for f in others]
    assert together.result().choices[0].text == alone
    assert client.completions.create(prompt=prompts[3], **{**options, "seed": 12}).choices[0].text != alone


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == ["t5-demo"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


BAD = [
    ("not json", None, "not valid JSON"),
    ({"model": "t5-demo"}, None, "prompt"),
    ({"model": "t5-demo", "prompt": "x", "max_tokens": "many"}, None, "max_tokens"),
    ({"model": "t5-demo", "prompt": "x", "max_tokens": 0}, None, "max_tokens must be an integer in [1, 2**31)"),
    ({"model": "t5-demo", "prompt": "x", "delta": 1.5}, None, "delta must be a number in [0, 1]"),
    ({"model": "t5-demo", "prompt": "x", "top_p": 0}, None, "top_p must be a number in (0, 1]"),
    ({"model": "t5-demo", "prompt": "x", "temperature": -1}, None, "temperature must be a number in [0, 100]"),
    ({"model": "t5-demo", "prompt": "x", "num_draft": 0}, None, "num_draft must be an integer in [1, 64] or auto"),
    ({"model": "t5-demo", "prompt": "x", "num_draft": "lots"}, None, "num_draft must be an integer in [1, 64] or auto"),
    ({"model": "t5-demo", "prompt": "x", "seed": -3}, None, "seed must be an integer in [0, 2**64)"),
    ({"model": "t5-demo", "prompt": "x", "n": 0}, None, "n: Input should be greater than or equal to 1"),
    ({"model": "t5-demo", "prompt": "x", "best_of": 3}, None, "best_of (more samples than returned) is not supported"),
    ({"model": "t5-demo", "prompt": "x", "use_beam_search": True}, None, "use_beam_search needs best_of"),
    ({"model": "t5-demo", "prompt": "x", "use_beam_search": True, "n": 2, "stream": True}, None, "does not stream"),
    ({"model": "t5-demo", "prompt": "x", "use_beam_search": True, "n": 2, "prompt_lookup": True}, None,
     "beam search decodes greedily with the target alone: it does not take prompt lookup"),
    ({"model": "t5-demo", "prompt": "x", "use_beam_search": True, "n": 2, "temperature": 1}, None,
     "it does not take sampling"),
    ({"model": "t5-demo", "prompt": "x", "length_penalty": 2.0}, None, "length_penalty and early_stopping go with beam search"),
    ({"model": "t5-demo", "prompt": "x", "no_repeat_ngram_size": 65}, None, "no_repeat_ngram_size must be an integer in [0, 64]"),
    # OpenAI's fields for what this server cannot do: named, not ignored
    ({"model": "t5-demo", "prompt": "x", "echo": True}, None, "echo is not supported"),
    ({"model": "t5-demo", "prompt": "x", "suffix": "end"}, None, "suffix is not supported"),
    ({"model": "t5-demo", "prompt": "x", "response_format": {"type": "json_object"}}, None, "response_format is not supported"),
    ({"model": "t5-demo", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, None,
     "tools is not supported"),
    ({"model": "t5-demo", "prompt": "x", "no_repeat_ngram_size": -1}, None, "no_repeat_ngram_size must be an integer in [0, 64]"),
    ({"model": "t5-demo", "prompt": "x", "stop_token_ids": [10**9]}, None, "stop_token_ids must be token ids below"),
    ({"model": "t5-demo", "prompt": "x", "stop_token_ids": ["3"]}, None, "stop_token_ids.0: Input should be a valid integer"),
    ({"model": "t5-demo", "prompt": "   "}, None, "the prompt is empty"),
    ({"model": "t5-demo", "prompt": []}, None, "the prompt is empty"),
    ({"model": "t5-demo", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, None, "up to 4"),
    ({"model": "t5-demo", "prompt": "x", "num_draft": "auto", "prompt_lookup": True}, None, "prompt lookup takes a number"),
    ({"model": "t5-demo", "prompt": ["x", 5]}, None, "prompt"),
    # strict types, as OpenAI's: no numbers in strings, no booleans for numbers or from words
    ({"model": "t5-demo", "prompt": "x", "max_tokens": "10"}, None, "max_tokens: Input should be a valid integer"),
    ({"model": "t5-demo", "prompt": "x", "max_tokens": True}, None, "max_tokens: Input should be a valid integer"),
    ({"model": "t5-demo", "prompt": "x", "prompt_lookup": "yes"}, None, "prompt_lookup: Input should be a valid boolean"),
    ({"model": "t5-demo", "prompt": "x", "temperature": "0.5"}, None, "temperature: Input should be a valid number"),
    ({"model": "t5-demo", "prompt": "x", "num_draft": "3"}, None, "num_draft must be an integer in [1, 64] or auto"),
    # limits: max_tokens up to --max-tokens-limit (4096 by default)
    ({"model": "t5-demo", "prompt": "x", "max_tokens": 10**30}, None, "max_tokens must be an integer in [1, 2**31)"),
    ({"model": "t5-demo", "prompt": "x", "max_tokens": 5000}, None, "more than this server's 4,096"),
    ({"model": "t5-demo", "prompt": "x", "max_tokens": 4097}, None, "max_tokens is 4,097"),
    # a lone surrogate (JSON's "\ud800") is no text a tokenizer takes
    ({"model": "t5-demo", "prompt": "import \ud800 <extra_id_0>"}, None, "not valid Unicode"),
    ({"model": "t5-demo", "prompt": "x", "stop": ["\udfff"]}, None, "not valid Unicode"),
]


@pytest.mark.parametrize("body, code, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_gets_a_400_with_openais_error_json(server, body, code, message):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"] == code


@pytest.mark.parametrize("messages, message", [
    ([], "user message"),
    ([{"role": "system", "content": "x"}], "user message"),
    ([{"role": "wizard", "content": "x"}], "unknown role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
])
def test_a_bad_chat_request_gets_a_400(server, messages, message):
    with pytest.raises(openai.BadRequestError, match=message):
        server.client().chat.completions.create(model="t5-demo", messages=messages)


def test_a_chat_message_with_a_lone_surrogate_gets_a_400(server):
    """JSON can escape one ("\\ud800"), which no UTF-8 client library would send."""
    body = json.dumps({"model": "t5-demo", "messages": [{"role": "user", "content": "a \ud800"}]})
    response = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid Unicode" in response.json()["error"]["message"]


def test_errors_reach_the_client_as_openais_exception_types(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="t5-demo", prompt="x", extra_body={"delta": 7})
    assert raised.value.status_code == 400 and "delta" in raised.value.message


PACED = """
import sys, time
import decoder, server
for batch in (decoder.RegularBatch, decoder.SpeculativeBatch):
    def round(self, real=batch.round):
        time.sleep(0.005)
        return (yield from real(self))
    batch.round = round
sys.exit(server.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def strict_server(v1_1_checkpoint):
    """One row, one waiting request, an API key, short prompts and small
    bodies; a random checkpoint decoding alone, whose greedy answers run to
    max_tokens (test_model.py: 64 tokens without an end), its rounds paced
    to 5 ms so that long answers stay in flight."""
    running = Server("--model", str(v1_1_checkpoint.mlx_dir), "--max-batch", "1", "--max-queue", "1",
                     "--api-key", "sesame", "--max-prompt-tokens", "80", "--max-body-bytes", "2000",
                     "--max-tokens-limit", "100000", "--served-model-name", "strict", code=PACED)
    yield running
    assert running.stop() == 0


KEY = {"Authorization": "Bearer sesame"}
LONG = {"model": "strict", "prompt": PROMPT, "max_tokens": 400}


def test_the_api_key_is_required_and_checked(strict_server):
    with pytest.raises(openai.AuthenticationError):
        strict_server.client(api_key="wrong").completions.create(model="strict", prompt=PROMPT, max_tokens=2)
    assert httpx.post(strict_server.url + "/v1/completions", json=LONG).status_code == 401
    reply = strict_server.client(api_key="sesame").completions.create(model="strict", prompt=PROMPT, max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_a_full_queue_answers_429_with_retry_after_and_keeps_serving(strict_server):
    """The decoding row is a stream held open until the refusals are checked
    (a short request could finish in between and empty the queue); closing it
    frees the row for the one waiting, which then runs to its end."""
    waiting = []
    with httpx.stream("POST", strict_server.url + "/v1/completions", headers=KEY, timeout=60,
                      json={**LONG, "max_tokens": 5000, "stream": True}) as decoding:
        lines = decoding.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(line for line in lines if line.startswith("data:"))
        thread = threading.Thread(target=lambda: waiting.append(
            httpx.post(strict_server.url + "/v1/completions", json=LONG, headers=KEY, timeout=120)))
        thread.start()
        wait_for(strict_server, lambda m: m[RUNNING] == 1 and m[WAITING] == 1)
        refused = httpx.post(strict_server.url + "/v1/completions", json=LONG, headers=KEY)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            strict_server.client(api_key="sesame").completions.create(**LONG)
    thread.join()
    assert waiting[0].json()["choices"][0]["finish_reason"] == "length"


RUNNING, WAITING, CANCELLED = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:rows_cancelled_total"


def wait_for(server: Server, condition, seconds: float = 30) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        metrics = server.metrics(headers=KEY)
        if condition(metrics):
            return metrics
        time.sleep(0.02)
    raise TimeoutError(metrics)


def test_a_client_that_disconnects_mid_stream_frees_its_row_at_the_next_round(strict_server):
    """And the server's log says the answer was cut short, as it says an answer sent whole was."""
    before, left = strict_server.metrics(headers=KEY)[CANCELLED], len(log_lines(strict_server, "the client left"))
    with httpx.stream("POST", strict_server.url + "/v1/completions", headers=KEY, timeout=30,
                      json={**LONG, "max_tokens": 5000, "stream": True}) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(line for line in lines if line.startswith("data:"))
        assert strict_server.metrics(headers=KEY)[RUNNING] == 1
    wait_for(strict_server, lambda m: m[RUNNING] == 0 and m[CANCELLED] == before + 1, seconds=10)
    reply = strict_server.client(api_key="sesame").completions.create(model="strict", prompt=PROMPT, max_tokens=3)
    assert reply.usage.completion_tokens == 3
    wait_for_log(strict_server, "the client left before the end", left + 1)  # the stream's
    assert f"{reply.id} prompt" in strict_server.output() and len(log_lines(strict_server, "the client left")) == left + 1


def log_lines(server: Server, text: str) -> list[str]:
    return [line for line in server.output().splitlines() if text in line]


def wait_for_log(server: Server, text: str, count: int, seconds: float = 10) -> None:
    """Until the server's log has `count` lines with `text` in them."""
    deadline = time.time() + seconds
    while len(log_lines(server, text)) < count and time.time() < deadline:
        time.sleep(0.02)
    assert len(log_lines(server, text)) == count, server.output()[-2000:]


def test_a_prompt_too_long_and_a_body_too_big_are_refused(strict_server):
    long = httpx.post(strict_server.url + "/v1/completions", headers=KEY, json={"model": "strict", "prompt": PROMPT * 2})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    big = httpx.post(strict_server.url + "/v1/completions", headers=KEY, json={"model": "strict", "prompt": "x" * 5000})
    assert big.status_code == 413 and "bytes" in big.json()["error"]["message"]




def test_sigterm_finishes_what_is_in_flight_refuses_the_rest_and_exits_0(v1_1_checkpoint):
    """Requests taken before the signal all complete, exactly (a random
    checkpoint's answers run to max_tokens, and rounds paced to 5 ms keep
    them in flight: unpaced, 300 tokens took 0.1 s); new ones get a 503, and
    the process exits 0."""
    running = Server("--model", str(v1_1_checkpoint.mlx_dir), "--max-batch", "2", "--max-queue", "8", code=PACED)
    asked = [PROMPT[: 40 + 10 * i] for i in range(4)]  # two decoding, two waiting
    answers = {}

    def ask(i):
        body = {"model": "default", "prompt": asked[i], "max_tokens": 300}
        answers[i] = httpx.post(running.url + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    wait_for(running, lambda m: m[RUNNING] == 2 and m[WAITING] == 2)
    running.process.send_signal(signal.SIGTERM)
    deadline = time.time() + 10
    while httpx.get(running.url + "/health").status_code != 503 and time.time() < deadline:
        time.sleep(0.01)
    late = httpx.post(running.url + "/v1/completions", json={"model": "default", "prompt": "x"})
    assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
    assert late.headers["retry-after"] == "1"
    for thread in threads:
        thread.join()
    assert running.stop() == 0 and "stopping: finishing 4 requests" in running.output()
    models = load(v1_1_checkpoint.mlx_dir)
    for i, prompt in enumerate(asked):
        assert answers[i].status_code == 200
        assert answers[i].json()["choices"][0]["text"] == generate(models, prompt, max_tokens=300, **TEXT)


FAILING = """
import sys
import decoder, server
real = decoder.SpeculativeBatch.round
def round(self):
    if any(1 in row.request.source[:1] for row in self.rows):  # a prompt whose first token is EOS
        raise RuntimeError("a planted failure")
    return (yield from real(self))
decoder.SpeculativeBatch.round = round
sys.exit(server.main(sys.argv[1:]))
"""


def test_a_failing_round_fails_its_batchs_requests_only_and_the_server_goes_on(models, prompts):
    running = Server(*PAIR, code=FAILING)
    try:
        client = running.client()
        with ThreadPoolExecutor(2) as pool:
            poisoned = pool.submit(httpx.post, running.url + "/v1/completions", timeout=60,
                                   json={"model": "default", "prompt": "</s> x", "max_tokens": 20})
            other = pool.submit(client.completions.create, model="default", prompt=prompts[0], max_tokens=20,
                                extra_body={"prompt_lookup": True, "delta": 0})  # a batch of another kind
            assert poisoned.result().status_code == 500
            assert poisoned.result().json()["error"]["message"].startswith("decoding failed: a planted failure")
            assert other.result().choices[0].text == generate(models, prompts[0], max_tokens=20, prompt_lookup=True,
                                                              **TEXT)
        again = client.completions.create(model="default", prompt=prompts[1], max_tokens=10, extra_body=EXACT)
        assert again.choices[0].text == generate(models, prompts[1], max_tokens=10, **EXACT, **TEXT)
    finally:
        assert running.stop() == 0


# ---------------------------------------------------------------- what a client meets (issue: the server in production)


def test_an_unknown_model_is_a_404_as_openai_and_vllm_answer(server):
    with pytest.raises(openai.NotFoundError) as raised:
        server.client().completions.create(model="gpt-4", prompt="x")
    assert raised.value.body["code"] == "model_not_found" and raised.value.body["param"] == "model"


@pytest.mark.parametrize("options", [{"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-300}],
                         ids=["tiny temperature", "tiny top_p"])
def test_a_vanishing_temperature_or_top_p_decodes_greedily(server, models, prompts, options):
    """Below 1e-5 a temperature is greedy; a top_p that float32 rounds to 0 keeps the most likely token."""
    reply = server.client().completions.create(model="t5-demo", prompt=prompts[0], max_tokens=20, **options,
                                               extra_body=EXACT)
    assert reply.choices[0].text == generate(models, prompts[0], max_tokens=20, **EXACT, **TEXT)


def test_a_seeded_sampling_request_with_num_draft_auto_gives_one_answer_however_often_sent(server, prompts):
    """What auto learns between sends would change which draws decide each
    token: a seeded request drafts a fixed length instead (Settings.draft_length)."""
    client = server.client()
    options = dict(model="t5-demo", prompt=prompts[2], max_tokens=30, temperature=1.0, seed=5,
                   extra_body={"num_draft": "auto", "delta": 0})
    answers = {client.completions.create(**options).choices[0].text for _ in range(5)}
    with ThreadPoolExecutor(4) as pool:  # and among other requests, which auto learns from too
        others = [pool.submit(client.completions.create, model="t5-demo", prompt=p, max_tokens=30, temperature=1.0,
                              extra_body={"num_draft": "auto"}) for p in prompts[:6]]
        answers.add(pool.submit(client.completions.create, **options).result().choices[0].text)
        [f.result() for f in others]
    fixed = {**options, "extra_body": {"num_draft": SEEDED_AUTO_DRAFTS, "delta": 0}}
    assert answers == {client.completions.create(**fixed).choices[0].text}


def test_chat_takes_max_completion_tokens_and_content_given_as_text_parts(server, models):
    parts = [{"type": "text", "text": "Fill in the code."}, {"type": "text", "text": "import <extra_id_0>"}]
    reply = server.client().chat.completions.create(model="t5-demo", messages=[{"role": "user", "content": parts}],
                                                    max_completion_tokens=4, extra_body={**EXACT, "ignore_eos": True})
    assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == generate(models, "Fill in the code.\nimport <extra_id_0>", max_tokens=4,
                                                        ignore_eos=True, **EXACT, **TEXT)


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(server, models):
    """vLLM's skip_special_tokens, true by default: "import <extra_id_0>" answers a sentinel first."""
    kept = generate(models, "import <extra_id_0>", max_tokens=8, **EXACT)
    assert "<extra_id_0>" in kept
    client = server.client()
    skipped = client.completions.create(model="t5-demo", prompt="import <extra_id_0>", max_tokens=8, extra_body=EXACT)
    assert "<extra_id" not in skipped.choices[0].text
    assert skipped.choices[0].text == generate(models, "import <extra_id_0>", max_tokens=8, **EXACT, **TEXT)
    asked = client.completions.create(model="t5-demo", prompt="import <extra_id_0>", max_tokens=8,
                                      extra_body={**EXACT, "skip_special_tokens": False})
    assert asked.choices[0].text == kept


def test_chat_choices_carry_logprobs_null_and_chunks_usage_null_before_the_usage_chunk(server):
    """The fields OpenAI sends as null: some clients index them without a default."""
    body = {"model": "t5-demo", "messages": [{"role": "user", "content": "import <extra_id_0>"}], "max_tokens": 5}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["logprobs"] is None
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])


def test_metrics_are_prometheus_text_with_vllms_names(server, prompts):
    """Read by prometheus_client's parser: tokens, finish reasons, error
    statuses, latency histograms, and drafted against accepted tokens."""
    before = server.metrics()
    client = server.client()
    client.completions.create(model="t5-demo", prompt=prompts[0], max_tokens=12, extra_body=EXACT)
    client.completions.create(model="t5-demo", prompt=prompts[1], max_tokens=2, extra_body={**EXACT, "ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="t5-demo", prompt="x", extra_body={"delta": 2})
    after = server.metrics()

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew('vllm:request_success_total{finished_reason="length"}') >= 1
    assert grew('vllm:request_errors_total{status="400"}') == 1
    assert grew("vllm:prompt_tokens_total") > 0 and grew("vllm:generation_tokens_total") >= 14
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"):
        assert grew(f"vllm:{histogram}_count") >= 2, histogram
    drafted, accepted = grew("vllm:spec_decode_num_draft_tokens_total"), grew("vllm:spec_decode_num_accepted_tokens_total")
    assert drafted >= accepted > 0 and grew("vllm:spec_decode_num_drafts_total") > 0
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["process_resident_memory_bytes"] > 0


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_row(strict_server):
    """No stream to notice it: the request's disconnect is watched for, and
    the row leaves at the next round (5,000 paced tokens would take 25 s),
    and the log says the answer was not sent."""
    before, left = strict_server.metrics(headers=KEY), len(log_lines(strict_server, "the client left"))
    with pytest.raises(openai.APITimeoutError):  # a client's timeout, as pipelines set one
        strict_server.client(api_key="sesame", timeout=0.5).completions.create(
            **{**LONG, "max_tokens": 5000}, extra_body={"ignore_eos": True})
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    wait_for(strict_server, lambda m: m[RUNNING] == 0 and m.get(abort, 0) == before.get(abort, 0) + 1, seconds=5)
    wait_for_log(strict_server, "the client left before the end", left + 1)


def test_a_prompt_list_the_queue_could_never_hold_is_a_400_not_a_429(strict_server):
    """A 429 tells a client to retry, which could never succeed: the queue holds 1."""
    response = httpx.post(strict_server.url + "/v1/completions", headers=KEY,
                          json={"model": "strict", "prompt": ["a", "b"], "max_tokens": 2})
    assert response.status_code == 400 and "more than this server's queue holds (1)" in response.json()["error"]["message"]


def test_the_key_guards_metrics_and_the_schema_and_its_scheme_is_case_insensitive(strict_server):
    for path in ("/metrics", "/openapi.json"):
        assert httpx.get(strict_server.url + path).status_code == 401
        assert httpx.get(strict_server.url + path, headers=KEY).status_code == 200
    assert httpx.get(strict_server.url + "/health").status_code == 200  # load balancers probe without it
    body = {"model": "strict", "prompt": "x", "max_tokens": 1}
    for scheme in ("bearer", "BEARER"):
        ok = httpx.post(strict_server.url + "/v1/completions", json=body, headers={"Authorization": f"{scheme} sesame"})
        assert ok.status_code == 200


def test_a_stream_whose_client_left_before_its_first_event_still_cancels_its_jobs():
    """Starlette, finding the client gone while the response's start is
    still being sent, cancels the stream before its generator starts, so the
    generator's own cleanup never runs: the response itself cancels the jobs."""
    import asyncio

    from serving.streams import Events

    class Job:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    started, jobs = [], [Job(), Job()]

    async def events():
        started.append(True)
        yield "data: [DONE]\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):  # uvicorn's waits while the connection's buffer is full (a client not reading)
        await asyncio.sleep(0)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}
    asyncio.run(Events(events(), jobs)(scope, receive, send))
    assert not started and all(job.cancelled for job in jobs)


# ---------------------------------------------------------------- token ids (issue: decoding controls, for pipelines)


def test_tokenize_and_detokenize_as_vllm_answers_them(server, models):
    ids = models.tokenizer.encode("import <extra_id_0>")
    tokenized = httpx.post(server.url + "/tokenize", json={"model": "t5-demo", "prompt": "import <extra_id_0>",
                                                           "return_token_strs": True}).json()
    assert tokenized == {"count": len(ids), "max_model_len": 4096, "tokens": ids,
                         "token_strs": [models.tokenizer.decode([i]) for i in ids]}
    bare = httpx.post(server.url + "/tokenize", json={"prompt": "import <extra_id_0>", "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[:-1]  # no end-of-text token
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "import <extra_id_0>"}]})
    assert chat.json()["tokens"] == ids
    back = httpx.post(server.url + "/detokenize", json={"model": "t5-demo", "tokens": ids}).json()
    assert back == {"prompt": models.tokenizer.decode(ids)} and back["prompt"].endswith("<extra_id_0></s>")
    for path, body, status in [("/detokenize", {"tokens": [len(models.tokenizer)]}, 400),
                               ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404),
                               ("/tokenize", {"prompt": "x", "messages": []}, 400)]:
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == status and "error" in response.json(), (path, body)


def test_prompts_given_as_token_ids_answer_as_their_text_does(server, models, prompts):
    client = server.client()
    ids = [models.tokenizer.encode(p) for p in prompts[:2]]
    one = client.completions.create(model="t5-demo", prompt=ids[0], max_tokens=12, extra_body=EXACT)
    assert one.choices[0].text == generate(models, prompts[0], max_tokens=12, **EXACT, **TEXT)
    assert one.usage.prompt_tokens == len(ids[0])
    both = client.completions.create(model="t5-demo", prompt=ids, max_tokens=12, extra_body=EXACT)
    assert [c.text for c in both.choices] == [generate(models, p, max_tokens=12, **EXACT, **TEXT) for p in prompts[:2]]
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        client.completions.create(model="t5-demo", prompt=[5, len(models.tokenizer)], max_tokens=2)


def test_truncate_prompt_tokens_keeps_a_long_prompts_last_tokens(strict_server, v1_1_checkpoint):
    """The strict server takes 80 tokens: a longer prompt is a 400, unless cut to its last ones."""
    ids = load(v1_1_checkpoint.mlx_dir).tokenizer.encode(PROMPT * 2)
    assert len(ids) > 80
    client = strict_server.client(api_key="sesame")
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="strict", prompt=PROMPT * 2, max_tokens=3)
    cut = client.completions.create(model="strict", prompt=PROMPT * 2, max_tokens=3,
                                    extra_body={"truncate_prompt_tokens": 40})
    assert cut.usage.prompt_tokens == 40
    assert cut.choices[0].text == client.completions.create(model="strict", prompt=ids[-40:], max_tokens=3).choices[0].text


def test_penalties_ride_on_requests_with_openais_and_vllms_names(server, models, prompts):
    options = dict(presence_penalty=1.0, frequency_penalty=0.5)
    vllms = {"repetition_penalty": 1.2, "min_tokens": 5, "no_repeat_ngram_size": 3, "stop_token_ids": [3]}
    reply = server.client().completions.create(model="t5-demo", prompt=prompts[1], max_tokens=30, **options,
                                               extra_body={**EXACT, **vllms})
    assert reply.choices[0].text == generate(models, prompts[1], max_tokens=30, **options, **vllms, **EXACT, **TEXT)
    assert reply.choices[0].text != generate(models, prompts[1], max_tokens=30, **EXACT, **TEXT)
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be a number in"):
        server.client().completions.create(model="t5-demo", prompt="x", presence_penalty=3)
    biased = server.client().completions.create(model="t5-demo", prompt=prompts[1], max_tokens=20, logit_bias={"2099": -100},
                                                extra_body=EXACT)
    assert biased.choices[0].text == generate(models, prompts[1], max_tokens=20, logit_bias={2099: -100}, **EXACT, **TEXT)
    for bias, message in (({"x": 1}, "keys must be token ids"), ({"5": 101}, "values must be numbers in"),
                          ({"99999": 1}, "below 2,100")):
        with pytest.raises(openai.BadRequestError, match=message):
            server.client().completions.create(model="t5-demo", prompt="x", logit_bias=bias)


def test_logprobs_come_in_openais_shapes_whole_and_streamed(server, models, prompts):
    """Completions: parallel lists whose tokens spell the text; chat: token
    objects with their bytes and alternatives; streamed chunks carry the same
    ones, each with its own tokens. Each value is the API's."""
    client = server.client()
    _, expected = zip(*[(r.token, r.logprob) for r in stream_generate(models, prompts[1], max_tokens=15, logprobs=2,
                                                                       **EXACT, **TEXT) if r.token is not None])
    reply = client.completions.create(model="t5-demo", prompt=prompts[1], max_tokens=15, logprobs=2, extra_body=EXACT)
    given = reply.choices[0].logprobs
    assert reply.choices[0].text.strip() in "".join(given.tokens)  # with the special tokens the text leaves out
    np.testing.assert_allclose(given.token_logprobs, [lp for lp, _ in expected], atol=1e-4)
    assert all(len(top) <= 3 and token in top for token, top in zip(given.tokens, given.top_logprobs))
    assert given.text_offset == sorted(given.text_offset) and len(given.text_offset) == len(given.tokens)

    messages = [{"role": "user", "content": prompts[1]}]
    chat = client.chat.completions.create(model="t5-demo", messages=messages, max_tokens=15, logprobs=True, top_logprobs=2,
                                          extra_body=EXACT)
    content = chat.choices[0].logprobs.content
    np.testing.assert_allclose([t.logprob for t in content], [lp for lp, _ in expected], atol=1e-4)
    assert all(len(t.top_logprobs) == 2 and bytes(t.bytes).decode() == t.token for t in content)
    assert [t.token for t in content] == given.tokens
    chunks = list(client.chat.completions.create(model="t5-demo", messages=messages, max_tokens=15, logprobs=True,
                                                 top_logprobs=2, stream=True, extra_body=EXACT))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model="t5-demo", messages=messages, max_tokens=5)
    assert plain.choices[0].logprobs is None
    for options, message in ((dict(top_logprobs=2), "top_logprobs needs logprobs"),
                             (dict(logprobs=True, top_logprobs=21), "top_logprobs must be an integer in")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="t5-demo", messages=messages, **options)


def test_n_samples_of_one_prompt_are_choices_each_the_api_at_its_seed(server, models, prompts):
    """n rows of one encoding; choice j is the sample seed + j gives alone."""
    options = dict(max_tokens=15, temperature=1.0, seed=7)
    reply = server.client().completions.create(model="t5-demo", prompt=prompts[2], n=3, **options, extra_body=EXACT)
    texts = [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]
    assert texts == [generate(models, prompts[2], max_tokens=15, temp=1.0, seed=7 + j, **EXACT, **TEXT) for j in range(3)]
    assert len(set(texts)) > 1 and reply.usage.prompt_tokens == len(models.tokenizer.encode(prompts[2]))
    chat = server.client().chat.completions.create(model="t5-demo", messages=[{"role": "user", "content": prompts[2]}], n=2,
                                                   **options, extra_body=EXACT)
    assert [c.index for c in chat.choices] == [0, 1] and [c.message.content for c in chat.choices] == texts[:2]


def test_beam_search_answers_its_n_best_beams_as_the_api_finds_them(server, models, prompts):
    options = dict(num_beams=4, num_return_sequences=2, length_penalty=0.8, max_tokens=20)
    expected = batch_generate(models, prompts[:2], **options, speculative=False, **TEXT)
    reply = server.client().completions.create(model="t5-demo", prompt=prompts[:2], n=2, max_tokens=20, best_of=4,
                                               extra_body={"use_beam_search": True, "length_penalty": 0.8})
    assert [c.text for c in reply.choices] == [text for g in expected for text, _ in g.beams]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    # a stop string cuts every beam, and says so, and usage counts what the client got
    cut = server.client().completions.create(model="t5-demo", prompt=prompts[1], n=2, max_tokens=20, best_of=3, stop=["path"],
                                             extra_body={"use_beam_search": True})
    whole = server.client().completions.create(model="t5-demo", prompt=prompts[1], n=2, max_tokens=20, best_of=3,
                                               extra_body={"use_beam_search": True})
    for short, full in zip(cut.choices, whole.choices):
        assert full.text.startswith(short.text)
        assert short.finish_reason == ("stop" if "path" in full.text else full.finish_reason)
    assert any("path" in c.text for c in whole.choices), "a beam must hold the stop string for this to test anything"
    assert cut.usage.completion_tokens < whole.usage.completion_tokens
    assert expected[0].beams[0][0] != generate(models, prompts[0], max_tokens=20, speculative=False, **TEXT) or \
        expected[1].beams[0][0] != generate(models, prompts[1], max_tokens=20, speculative=False, **TEXT)
