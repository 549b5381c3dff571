"""The server's one cache budget (--cache-memory, serving/budget.py): a flood of large requests against a small
budget all complete, each as `generate` alone, with MLX's peak memory within the budget and the weights; a request
that could never fit is a 400; a job waiting for room neither blocks the jobs that fit nor is starved by them."""

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import main
from generate import generate
from loading import load
from options import Settings
from rows import Request
from serving.budget import ENCODING_MEASURED, PASSES, Budget, encoding_memory, weights_bytes
from serving.engine import Engine
from serving.jobs import Job
from serving.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
EXACT = {"delta": 0, "num_draft": 3, "skip_special_tokens": True}
LARGE = 100  # max_tokens of the flood's requests (past their end of text)
FLOOD = 9  # requests at once: past the 8 rows, so that without a budget every row fills


@pytest.fixture(scope="module")
def demo():
    models = load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")
    prompts = main.demo_prompts()
    long = [" ".join(prompts[i:] + prompts[:i])[:2400] for i in range(FLOOD)]  # some 1,000 tokens each, all different
    return models, long


def flood(server: ServerProcess, prompts: list[str]) -> tuple[list[str], int]:
    """Every prompt at once (max_tokens LARGE, past the end of text); the answers, and the most rows seen running."""
    url, most = server.url + "/v1/completions", 0

    def ask(prompt):
        body = {"model": "default", "prompt": prompt, "max_tokens": LARGE, "ignore_eos": True, **EXACT}
        reply = httpx.post(url, json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = [pool.submit(ask, prompt) for prompt in prompts]
        deadline = time.monotonic() + 300
        while not all(answer.done() for answer in answers) and time.monotonic() < deadline:
            most = max(most, server.metrics()["vllm:num_requests_running"])
            time.sleep(0.05)
        return [answer.result(timeout=1) for answer in answers], most  # (a failed request raises here)


def test_a_flood_of_large_requests_fits_a_small_budget_and_every_answer_is_generates(demo):
    """9 requests at once, each able to hold some 18 MiB of cache (a prompt of
    about 1,000 tokens, 100 decoded) and 56 MiB more while its prompt is encoded, against a budget for 3 of them (one
    being encoded) and rows for 8: none fails or is lost, each answer is what
    it gets alone, at most 3 decode at once, and MLX's peak memory stays
    under the weights and the budget. Without the budget the same flood takes 8
    rows and passes that line: the check can fail."""
    models, prompts = demo
    budget = Budget(models, 1, encoding_memory(models, ENCODING_MEASURED))
    large = budget.footprint(Request(models.tokenizer.encode(prompts[0]),
                                     Settings(max_tokens=LARGE, speculative=True, num_draft=3)))
    three = budget.bytes([large] * 3, [large])
    limit = three + (budget.bytes([large] * 4, [large]) - three) // 2  # three of them at once, one being encoded
    options = ("--model", "demo/target", "--draft-model", "demo/draft", "--max-batch", "8", "--max-queue", "32")
    server = ServerProcess(*options, "--cache-memory", f"{limit / 2**30:.6f}")
    try:
        answers, most = flood(server, prompts)
        metrics = server.metrics()
    finally:
        assert server.stop() == 0
    assert answers == [generate(models, prompt, max_tokens=LARGE, ignore_eos=True, **EXACT) for prompt in prompts]
    assert 2 <= most <= 3
    assert metrics["vllm:cache_budget_bytes"] == pytest.approx(limit, rel=1e-5)
    weights = weights_bytes(models)
    assert metrics["vllm:memory_peak_bytes"] <= weights + limit, (metrics["vllm:memory_peak_bytes"] - weights, limit)
    unbounded = ServerProcess(*options)
    try:
        _, most = flood(unbounded, prompts)
        peak = unbounded.metrics()["vllm:memory_peak_bytes"]
    finally:
        assert unbounded.stop() == 0
    assert most >= 7 and peak > weights + limit, (most, peak - weights, limit)


def test_a_request_that_could_never_fit_the_budget_is_a_400_that_says_so(demo):
    models, prompts = demo
    budget = Budget(models, 1, encoding_memory(models, ENCODING_MEASURED))
    big = budget.alone(budget.footprint(Request(models.tokenizer.encode(prompts[0]), Settings(max_tokens=4000))))
    small = budget.alone(budget.footprint(Request(models.tokenizer.encode("Translate to German: a cat."),
                                                  Settings(max_tokens=8))))
    assert small < big
    server = ServerProcess("--model", "demo/target", "--cache-memory", f"{(small + big) / 2 / 2**30:.6f}")
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "default", "prompt": prompts[0], "max_tokens": 4000})
        fits = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": "default", "prompt": "Translate to German: a cat.", "max_tokens": 8})
    finally:
        assert server.stop() == 0
    assert reply.status_code == 400 and "--cache-memory" in reply.json()["error"]["message"]
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert fits.status_code == 200


def test_a_job_waiting_for_room_is_passed_by_jobs_that_fit_but_not_for_ever(demo):
    """In the order they came: a large job with no room waits while small
    ones behind it are taken, until PASSES have passed it; then nothing
    passes it, and it is taken first once room is freed."""
    models, _ = demo
    engine = Engine(models, Settings(), max_batch=64, max_queue=64, budget=Budget(models, 1))

    def job(tokens: int, max_tokens: int) -> Job:
        return Job(Request(list(range(tokens)), Settings(max_tokens=max_tokens, speculative=False)), None, None, None)

    # a batch pads its rows to its longest prompt and reach: beside the running job, a small one costs as much as
    # it, and the large one, able to write 20,000 tokens, far more
    running, large, small = job(1000, 100), job(1000, 20_000), [job(10, 10) for _ in range(PASSES + 3)]
    budget = engine.budget
    budget.limit = budget.bytes([budget.footprint(large.request)], [])  # the large one alone, or many small ones
    budget.held[id(running)] = budget.footprint(running.request)
    taken, left = budget.room_for([large, *small], 64)
    assert taken == small[:PASSES] and left == [large, *small[PASSES:]] and large.passed == PASSES
    taken, left = budget.room_for(left, 64)
    assert taken == [] and left == [large, *small[PASSES:]]  # nothing passes it now
    budget.held = {}  # the running job and the small ones ended
    taken, left = budget.room_for(left, 64)
    assert taken[0] is large


def test_a_batchs_caches_are_copied_a_layer_at_a_time_as_rows_join_and_leave():
    """What the budget counts on (cache.settle): as rows join a batch, leave it, or its room grows, MLX's peak
    memory passes what the caches hold before and after by one layer's storage at most, not by the whole cache."""
    import mlx.core as mx

    from cache import DecoderCache

    heads, dim, prompt, layers = 4, 32, 512, 6

    def batch(rows: int, output: int) -> DecoderCache:
        cross = [(mx.ones((rows, heads, prompt, dim)), mx.ones((rows, heads, prompt, dim))) for _ in range(layers)]
        cache = DecoderCache(cross, None)
        keys, values = cache.reserve(output)
        cache.advance(output, [k + 1 for k in keys], [v + 1 for v in values])
        mx.eval(cache.cross_keys_values, [layer.keys for layer in cache.self_attention])
        return cache

    def held(cache: DecoderCache) -> int:
        return sum(k.nbytes + v.nbytes for k, v in cache.cross_keys_values) + \
            sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.self_attention)

    def peak_over(change, cache: DecoderCache) -> int:
        """The peak past the larger of what is held before and after the change, the cache computed."""
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        change()
        mx.eval(cache.cross_keys_values, [(layer.keys, layer.values) for layer in cache.self_attention])
        return mx.get_peak_memory() - max(before, mx.get_active_memory())

    running, joining = batch(6, 300), batch(2, 100)
    layer = (held(running) + held(joining)) // layers  # a layer's storage, every row's, after the join
    assert peak_over(lambda: running.extend(joining), running) <= layer
    assert peak_over(lambda: running.keep([0, 2, 4, 6], prompt), running) <= held(running) // layers
    assert peak_over(lambda: running.reserve(400), running) <= 2 * held(running) // layers


def test_the_draft_catching_up_after_idle_rounds_stays_within_a_rounds_logits():
    """After rounds of no drafts, num-draft auto's draft is fed each row's tokens since (one a round, and the last
    one or two) in one call, whose logits span them all: that width stays within the logits the budget holds for a
    row (every copy of its verified positions'), so a long wait cannot overrun the budget."""
    from autodraft import AutoDraft
    from serving.budget import LOGIT_COPIES

    assert AutoDraft.idle_longest + 2 <= LOGIT_COPIES * (AutoDraft.cap + 1)
