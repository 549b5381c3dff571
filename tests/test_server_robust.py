"""No request can hurt another: every value a client sends has a bound checked at the edge (a 400 naming it), a row
that fails decoding fails alone while its batchmates answer as they would have, nothing that grows with a request
runs on the event loop, and the text's costs grow linearly with it."""

import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import EXACT, FAILING, PAIR, TEXT, Server  # FAILING: a planted failure where a prompt starts with EOS

from generate import batch_generate, generate
from text import Detokenizer, StopStrings, TextStream


@pytest.fixture(scope="module")
def server():
    running = Server(*PAIR, "--max-batch", "8", "--max-prompt-tokens", "4096")
    yield running
    assert running.stop() == 0


REFUSED = {  # what a hostile client sent, and the field the 400 names
    "top_k past any integer": ({"top_k": 2**63}, "top_k"),
    "top_k past the vocabulary": ({"top_k": 10**6}, "top_k"),
    "top_k a float": ({"top_k": 1e20}, "top_k"),
    "length_penalty 400": ({"use_beam_search": True, "n": 2, "length_penalty": 400}, "length_penalty"),
    "length_penalty -1e300": ({"use_beam_search": True, "n": 2, "length_penalty": -1e300}, "length_penalty"),
    "repetition_penalty 1e300": ({"repetition_penalty": 1e300}, "repetition_penalty"),
    "a logit_bias key of superscript two": ({"logit_bias": {"²": 1}}, "logit_bias"),
    "a logit_bias key of circled one": ({"logit_bias": {"①": 1}}, "logit_bias"),
    "301 logit_bias entries": ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    "a stop string of 1,001 characters": ({"stop": ["x" * 1001]}, "stop"),
    "5 stop strings": ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "65 stop token ids": ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    "min_tokens past max_tokens": ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    "n 17": ({"n": 17}, "n"),
    "best_of 17": ({"use_beam_search": True, "best_of": 17}, "best_of"),
    "a response_format": ({"response_format": {"type": "json_object"}}, "response_format"),
    "temperature 1e300": ({"temperature": 1e300}, "temperature"),
    "num_draft 1e9": ({"num_draft": 10**9}, "num_draft"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_every_value_a_client_sends_has_a_bound_and_past_it_a_400_names_the_field(server, case):
    fields, param = REFUSED[case]
    answer = httpx.post(server.url + "/v1/completions", json={"model": "default", "prompt": "x = 1", **fields}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_prompt_past_the_servers_characters_is_refused_before_it_is_tokenized(server):
    """--max-prompt-tokens 4096: 131,072 characters at most (32 a token), counted before any tokenizing."""
    for field, body in (("prompt", {"prompt": "a" * 131_073}),
                        ("messages", {"messages": [{"role": "user", "content": "a" * 131_073}]})):
        path = "/v1/completions" if field == "prompt" else "/v1/chat/completions"
        answer = httpx.post(server.url + path, json={"model": "default", **body}, timeout=30)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == field and error["code"] == "context_length_exceeded"
        assert "131,073 characters" in error["message"]


def test_a_long_prompt_is_encoded_in_turns_with_the_rows_decoding_and_health_answers_meanwhile(server):
    """A 4,096-token prompt sent while another request streams: the stream
    goes on while the prompt is encoded, its longest gap a small part of the
    long request's time (encoded at once, the prompt stopped the stream for
    all of its encoding), and /health answers within 100 ms throughout."""
    long_prompt = [3 + i % 2000 for i in range(4096)]
    stamps, measured = [], {}
    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=60) as probe:
        def stream():
            body = {"model": "default", "prompt": "x = 1", "max_tokens": 4000, "min_tokens": 4000, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as answer:
                assert answer.status_code == 200
                for line in answer.iter_lines():
                    stamps.append(time.perf_counter()) if line.startswith("data: {") else None
                    if "ended" in measured:
                        return

        streaming = pool.submit(stream)
        while len(stamps) < 20 and not streaming.done():
            time.sleep(0.01)
        assert len(stamps) >= 20, streaming.result()
        measured["sent"] = time.perf_counter()
        long = pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                           json={"model": "default", "prompt": long_prompt, "max_tokens": 1})
        health = []
        while not long.done():
            started = time.perf_counter()
            assert probe.get(server.url + "/health").status_code == 200
            health.append(time.perf_counter() - started)
            time.sleep(0.01)
        measured["ended"] = time.perf_counter()
        assert long.result().status_code == 200 and long.result().json()["usage"]["prompt_tokens"] == 4096
        streaming.result()
    sent, ended = measured["sent"], measured["ended"]
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b < sent]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if a >= sent and b <= ended]
    print(f"long request {ended - sent:.2f} s; the stream's gaps: {statistics.median(before) * 1e3:.1f} ms before, "
          f"{max(during) * 1e3:.1f} ms at most during; /health at most {max(health) * 1e3:.1f} ms of {len(health)}")
    assert len(during) >= 10 and max(during) < 0.2 * (ended - sent)
    assert max(health) < 0.1


def test_a_short_request_sent_just_after_a_long_prompt_is_answered_while_the_long_one_is_encoded(server):
    """With no other row decoding, the engine reads its queue between slices
    of a long prompt's encoding: a 5-token request sent once a 4,096-token
    prompt is taken takes a small part of the long one's time."""
    def timed(prompt, max_tokens):
        started = time.perf_counter()
        answer = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"model": "default", "prompt": prompt, "max_tokens": max_tokens})
        assert answer.status_code == 200
        return time.perf_counter() - started

    def running() -> float:
        metrics = httpx.get(server.url + "/metrics").text
        return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", metrics, re.M).group(1))

    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(timed, [3 + (i * 7919) % 2000 for i in range(4096)], 1)
        while running() < 1:  # the long one is taken (and encoding): the short one comes after it
            time.sleep(0.01)
        short = pool.submit(timed, "x = 1", 5)
        print(f"the long request {long.result():.2f} s, the short one {short.result():.2f} s")
        assert short.result() < 0.25 * long.result()


def test_null_is_the_default_where_openais_schema_allows_it_and_tokenize_refuses_what_chat_refuses(server):
    for path, body in (("/v1/completions", {"prompt": "x = 1", "n": None, "stream": None}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x = 1"}], "logprobs": None,
                                                 "n": None, "stream": None})):
        answer = httpx.post(server.url + path, json={"model": "default", "max_tokens": 3, **body}, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 1, answer.text
    for messages in ([], [{"role": "assistant", "content": "x = 1"}]):
        for path in ("/tokenize", "/v1/chat/completions"):
            answer = httpx.post(server.url + path, json={"model": "default", "messages": messages}, timeout=30)
            assert answer.status_code == 400 and "a user message" in answer.json()["error"]["message"], (path, messages)


def test_when_no_repeat_ngrams_leave_no_token_the_row_ends_and_keeps_the_rule(v1_1_checkpoint, unit_scale_pair):
    """no_repeat_ngram_size 1, and min_tokens holding back the end of text
    past the vocabulary's size: greedy, sampled, drafted and beam search each
    output every other token once, then end with the end of text, never
    repeating one; the server answers each. (A small model of the tests'
    vocabulary of 1,104 tokens: the demo target took 4 minutes over its
    2,100, each ban the same.)"""
    from loading import Models, load_tokenizer

    models = Models(*unit_scale_pair, load_tokenizer(v1_1_checkpoint.mlx_dir))
    vocabulary = models.target.args.vocab_size
    asked = dict(max_tokens=vocabulary + 50, min_tokens=vocabulary + 10, no_repeat_ngram_size=1)
    for options in ({"speculative": False}, {"temp": 1.0, "seed": 3}, {"num_draft": 3}, {"num_beams": 2}):
        generation = batch_generate(models, ["x = 1"], **asked, **options)[0]
        # every token once but the start (0, seen from the start) and the end of text (1)
        assert generation.finish_reason == "stop" and sorted(generation.tokens) == list(range(2, vocabulary)), options
    checkpoint = str(v1_1_checkpoint.mlx_dir)
    running = Server("--model", checkpoint, "--draft-model", checkpoint)
    try:
        for fields in ({}, {"temperature": 1.0, "seed": 3}, {"use_beam_search": True, "n": 2}):
            answer = httpx.post(running.url + "/v1/completions", timeout=120,
                                json={"model": "default", "prompt": "x = 1", **asked, **fields})
            assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "stop", answer.text
    finally:
        assert running.stop() == 0


def test_a_row_that_fails_fails_alone_and_its_batchmates_answer_token_for_token_as_they_would_have(
        demo_models, demo_prompts):
    """A poisoned prompt (a planted failure in any round its row is in)
    decodes in one batch with four others of its kind: it gets its 500 (its
    connection closed), they their exact answers, streamed or whole, however
    far they had got."""
    running = Server(*PAIR, "--max-batch", "8", code=FAILING)
    try:
        body = {"model": "default", "max_tokens": 40, **EXACT}
        with ThreadPoolExecutor(5) as pool:
            others = [pool.submit(httpx.post, running.url + "/v1/completions", timeout=120,
                                  json=body | {"prompt": prompt, "stream": i % 2 == 0})
                      for i, prompt in enumerate(demo_prompts[:4])]
            poisoned = pool.submit(httpx.post, running.url + "/v1/completions", timeout=120,
                                   json=body | {"prompt": "</s> x"})
            assert poisoned.result().status_code == 500 and poisoned.result().headers["connection"] == "close"
            assert poisoned.result().json()["error"]["message"] == "decoding failed: a planted failure"
            for i, (prompt, other) in enumerate(zip(demo_prompts, others)):
                answer = other.result()
                assert answer.status_code == 200
                if i % 2 == 0:  # streamed
                    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in answer.text.splitlines()
                                   if line.startswith("data: {"))
                else:
                    text = answer.json()["choices"][0]["text"]
                assert text == generate(demo_models, prompt, max_tokens=40, **EXACT, **TEXT)
    finally:
        assert running.stop() == 0
    assert "a decoding round failed" in running.output()


SLOW_TOKENIZER = """
import sys, threading
import loading, server
held = threading.Event()
real = loading.Tokenizer.encode
def encode(self, text, add_special_tokens=True):
    if "HOLD" in text:
        held.wait(30)  # until a request for "RELEASE" comes
    if "RELEASE" in text:
        held.set()
    return real(self, text, add_special_tokens)
loading.Tokenizer.encode = encode
sys.exit(server.main(sys.argv[1:]))
"""


def test_tokenizing_runs_off_the_event_loop(v1_1_checkpoint):
    """A prompt whose tokenizing is held (a planted wait) holds neither
    /health nor another request, whose own prompt releases it."""
    running = Server("--model", str(v1_1_checkpoint.mlx_dir), code=SLOW_TOKENIZER)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, running.url + "/tokenize", json={"prompt": "HOLD"}, timeout=60)
            assert httpx.get(running.url + "/health", timeout=10).status_code == 200
            assert not held.done()
            assert httpx.post(running.url + "/tokenize", json={"prompt": "RELEASE"}, timeout=10).status_code == 200
            assert held.result().status_code == 200
    finally:
        assert running.stop() == 0


FAILING_ROUTE = """
import sys
import server
from serving import app, shapes
def model_list(names):
    raise RuntimeError("a planted bug")
app.shapes.model_list = model_list
sys.exit(server.main(sys.argv[1:]))
"""


def test_an_unexpected_500_closes_its_connection(v1_1_checkpoint):
    running = Server("--model", str(v1_1_checkpoint.mlx_dir), code=FAILING_ROUTE)
    try:
        with httpx.Client() as client:
            answer = client.get(running.url + "/v1/models")
            assert answer.status_code == 500 and answer.headers["connection"] == "close"
            assert answer.json()["error"]["type"] == "server_error"
            assert client.get(running.url + "/health").status_code == 200  # on a new connection
    finally:
        assert running.stop() == 0


class Words:
    """A tokenizer of one character a token, ids 3 and up; 0-2 special, decoding as nothing when skipped. It counts
    the tokens each decode reads."""

    def __init__(self):
        self.read = 0

    def decode(self, ids, skip_special_tokens=False, **_):
        self.read += len(ids)
        return "".join("" if i < 3 and skip_special_tokens else "<s>" if i < 3 else chr(ord("a") + (i - 3) % 26)
                       for i in ids)

    def special_ids(self):
        return {0, 1, 2}


def test_the_texts_cost_grows_linearly_with_the_output():
    """Each token's decode reads a bounded window, also over a run of 2,000
    special tokens that decode to nothing; a stop string of 100,000
    characters is matched, and held back, in one pass over the text."""
    tokenizer = Words()
    detokenizer = Detokenizer(tokenizer, skip_special_tokens=True)
    text = "".join(detokenizer.add(token) for token in [5] + [1] * 2000 + [6, 7])
    assert text + detokenizer.flush() == "cde" and tokenizer.read < 20 * 2003
    stop = "ab" * 50_000
    stream = TextStream(Words(), (stop,))
    for token in [3, 4] * 49_999 + [3]:  # the stop string but its last character: all held back
        stream.add(token)
    assert stream.take() == "" and stream.stops.partial == len(stop) - 1
    stream.add(4)
    assert stream.finish_reason == "stop" and stream.take() == ""
    stops = StopStrings(("aab",))
    assert stops.feed("aaa") is None and stops.partial == 2 and stops.feed("ab") == 2


def test_a_replayed_job_checks_the_tokens_its_client_has_had_before_it_adds_any():
    """Engine.isolate's replay: the tokens the text has are decided again and
    checked, not added twice; another token, or an end before them, stops it."""
    import asyncio

    from rows import Request
    from serving.jobs import Job

    def job(replay):
        made = Job(Request([5, 1]), TextStream(Words()), asyncio.new_event_loop(), None, replay=list(replay))
        made.stream.add(3), made.stream.add(4)  # what its client had
        return made

    going = job([3, 4])
    assert going.accept(3, None) and going.accept(4, None) and going.accept(5, "length")
    assert going.stream.tokens == [3, 4, 5] and going.stream.take() == "abc"
    assert not job([3, 4]).accept(7, None)
    ended = job([3, 4])
    assert ended.accept(3, None) and not ended.accept(None, "stop")


def test_by_default_one_request_holds_at_most_what_a_minute_of_decoding_makes(demo_models):
    """With no --max-request-tokens, a request's tokens (each prompt's and
    max_tokens, for each of its rows) are at most what the pair decodes in 60
    s, a full batch at the server's defaults, or what 2 GiB of cache holds if
    less, as the log says; n=16 of 4,096 tokens each is refused past it."""
    import re

    import server as program

    running = Server(*PAIR, "--max-batch", "1")
    try:
        said = re.search(r"requests up to ([\d,]+) cache tokens: ([^;]*);", running.output())
        budget = int(said.group(1).replace(",", ""))
        per_token = sum(model.cache_bytes_per_token for model in (demo_models.target, demo_models.draft))
        held = program.CACHE_BUDGET // per_token
        rate = re.fullmatch(r"60 s of decoding at ([\d,]+) tokens/s", said.group(2))
        if rate:  # the clock decided: a minute at the logged rate (rounded to a token a second)
            assert budget < held and abs(budget - 60 * int(rate.group(1).replace(",", ""))) <= 60
        else:
            assert said.group(2) == "what 2 GiB of cache holds" and budget == held
        prompt = demo_models.tokenizer.encode("x = 1")
        needed = 16 * (len(prompt) + 4096)
        answer = httpx.post(running.url + "/v1/completions", timeout=600, json={
            "model": "default", "prompt": "x = 1", "n": 16, "max_tokens": 4096, "temperature": 1.0,
            **({} if needed > budget else {"stop": ["\\n"]})})
        if needed > budget:
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded"
        else:
            assert answer.status_code == 200
    finally:
        assert running.stop() == 0
