"""Regular decoding and draft-and-verify speculative decoding for T5.

Both are generators that yield token ids as they are decided, updating a
`Stats` object as they go. Both turn logits into a sampling distribution with
the same `logits_to_probs`.
"""

import time
from dataclasses import asdict, dataclass

import blas  # noqa: F401  (before mlx.core)
import mlx.core as mx

from model import T5


@dataclass
class Sampling:
    temp: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


@dataclass
class Stats:
    generated: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.generated / self.target_calls if self.target_calls else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def logits_to_probs(logits: mx.array, sampling: Sampling) -> mx.array:
    """Logits (..., vocab) -> float32 probabilities after temperature, top-k and top-p."""
    assert sampling.temp > 0, "greedy decoding takes the argmax, it has no distribution"
    logits = logits.astype(mx.float32) / sampling.temp
    if 0 < sampling.top_k < logits.shape[-1]:
        kth_largest = mx.sort(logits, axis=-1)[..., -sampling.top_k][..., None]
        logits = mx.where(logits < kth_largest, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if sampling.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < sampling.top_p
        keep = mx.put_along_axis(mx.zeros(probs.shape, mx.bool_), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def sample(logits: mx.array, sampling: Sampling) -> mx.array:
    """One token per row of logits (..., vocab) -> (...)."""
    if sampling.temp == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(mx.log(logits_to_probs(logits, sampling)))


def start_decoding(model: T5, prompt: list[int]):
    """Encode the prompt and return (cache, first decoder input)."""
    cache = model.make_cache(model.encode(mx.array([prompt])))
    return cache, mx.array([model.args.decoder_start_token_id])


def regular_generate(model: T5, prompt: list[int], max_tokens: int, sampling: Sampling, stats: Stats | None = None,
                     stop_at_eos: bool = True):
    """Yield up to max_tokens ids from the model alone, stopping at EOS
    (benchmarks turn that off to time a fixed number of tokens).

    The next step's graph is built and queued before the current token is read
    back, so Python work overlaps the model's compute.
    """
    stats = stats if stats is not None else Stats()
    started = time.perf_counter()
    cache, token = start_decoding(model, prompt)
    eos = model.args.eos_token_id

    def step(token: mx.array) -> mx.array:
        stats.target_calls += 1
        logits = model.decode(token[:, None], cache)[:, -1]
        return sample(logits, sampling)

    token = step(token)
    mx.async_eval(token)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_token = step(token)
            mx.async_eval(next_token)
        value = token.item()
        if value == eos and stop_at_eos:
            break
        stats.generated += 1
        stats.seconds = time.perf_counter() - started
        yield value
        if n + 1 < max_tokens:
            token = next_token
    stats.seconds = time.perf_counter() - started
