"""server.py under a bounded load on loopback, with clients that give up: afterwards every row is free, every
answer that completed is `generate`'s alone, and the process's memory has not grown."""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import main
from generate import generate
from loading import load
from serving.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
EXACT = {"delta": 0, "num_draft": 3, "skip_special_tokens": True}
RSS = "process_resident_memory_bytes"


def ask(url: str, body: dict, leave_after: float | None, chunks_before_leaving: int | None) -> str | None:
    """One request; the answer's text, or None for a client that left:
    a whole answer abandoned after `leave_after` seconds, a stream after some chunks."""
    if not body["stream"]:
        try:
            reply = httpx.post(url, json=body, timeout=leave_after or 120)
        except httpx.TimeoutException:  # a read timeout, or on a loaded machine a connect or write one
            return None
        return reply.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        for i, line in enumerate(response.iter_lines()):
            if chunks_before_leaving is not None and i >= chunks_before_leaving:
                return None  # leaving the block closes the connection mid-stream
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def load_round(url: str, prompts: list[str], seed: int) -> list[tuple[dict, str | None]]:
    """100 requests from 16 clients, a quarter leaving at a random point,
    streaming and not. Those that leave asked for 4,000 tokens past the end
    of text: seconds of decoding, had their rows stayed."""
    rng = random.Random(seed)
    plans = []
    for i in range(100):
        leaves = rng.random() < 0.25
        body = {"model": "default", "prompt": prompts[i % len(prompts)], "max_tokens": 4000 if leaves else rng.randint(8, 60),
                "ignore_eos": leaves, "stream": rng.random() < 0.5, **EXACT}
        plans.append((body, rng.uniform(0.005, 0.1) if leaves else None, rng.randint(1, 6) if leaves else None))
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda plan: ask(url, *plan), plans))
    return [(body, answer) for (body, _, _), answer in zip(plans, answers)]


def test_a_hundred_requests_with_a_quarter_abandoned_leave_no_row_and_no_memory_behind():
    models = load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")
    prompts = main.demo_prompts()
    server = ServerProcess("--model", "demo/target", "--draft-model", "demo/draft", "--max-batch", "8",
                           "--max-queue", "128")
    try:
        url = server.url + "/v1/completions"
        load_round(url, prompts, seed=1)  # warm-up: every batch size's shapes traced, the allocator's pools filled
        settle(server)
        before = server.metrics()
        answered = load_round(url, prompts, seed=2)
        after = settle(server)
    finally:
        assert server.stop() == 0
    completed = [(body, answer) for body, answer in answered if answer is not None]
    assert len(completed) == sum(not body["ignore_eos"] for body, _ in answered) >= 50  # all but those that left
    for body, answer in completed:
        assert answer == generate(models, body["prompt"], max_tokens=body["max_tokens"], **EXACT)
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] > before.get(aborted, 0)
    assert after[RSS] < 1.05 * before[RSS], (before[RSS], after[RSS])


def settle(server: ServerProcess, seconds: float = 3) -> dict:
    """The metrics once no row decodes and none waits: at once, as a row
    whose client left ends at the next round (4,000 tokens take longer)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        metrics = server.metrics()
        if metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0:
            return metrics
        time.sleep(0.05)
    raise AssertionError(f"rows still busy after the load: {metrics}")
