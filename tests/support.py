"""What the tests share: token ids decoded through the engine's one factory, one chi-square check, and one rule for
numbers compared with transformers'."""

import numpy as np

from batches import batch_for, drive
from checkpoints import farthest_float32, in_float64  # noqa: F401  (the tests take them from here)
from rows import Request
from loading import Models
from plans import resolve
from options import Settings, Stats


def decode(models: Models, prompt: list[int], settings: Settings = Settings(), stats: Stats | None = None) -> list[int]:
    """One prompt's token ids, decoded as `generate` decodes it: a batch of one (its settings resolved against the
    models: a target language opens the decoder)."""
    request = resolve(settings, models).request(prompt)
    request.stats = stats if stats is not None else Stats()
    return [token for _, token, _ in drive(batch_for(models, settings, 1), [request]) if token is not None]


def regular(target, prompt: list[int], max_tokens: int = 100, stats: Stats | None = None) -> list[int]:
    """The target's own greedy ids: regular decoding."""
    return decode(Models(target), prompt, Settings(max_tokens=max_tokens, speculative=False), stats)


def decode_batch(models: Models, requests: list[Request], batch_size: int) -> tuple[list[list[int]], list[int]]:
    """Each request's ids, decoded together batch_size rows at a time (the
    batch made for the first request's settings), and the requests' indices
    in the order their rows finished."""
    index = {id(request): i for i, request in enumerate(requests)}
    tokens, finished = [[] for _ in requests], []
    for request, token, finish in drive(batch_for(models, requests[0].settings, batch_size), requests):
        tokens[index[id(request)]] += [] if token is None else [token]
        if finish:
            finished.append(index[id(request)])
    return tokens, finished


def sampled(models: Models, prompt: list[int], settings: Settings, samples: int = 3000, rules: tuple = (),
            rows: int = 500) -> tuple[list[list[int]], Stats]:
    """`samples` outputs of one prompt, each drawn from a random stream of its own (mx.random's: seed it first), and
    their statistics together: decoded `rows` at a time, as a row draws what it would alone (sampling.py;
    test_a_seeded_row_samples_alone_as_among_others), in a fraction of the time runs alone take. 3,000 is what the
    weakest test needs: with a rejected draft resampled from the target's distribution instead of the residual,
    the penalised lookup's second token (1,239 of the samples) reached a chi-square of 55 against 24.3, the others
    150 to 460."""
    plan, outputs, totals = resolve(settings, models), [], Stats()
    for start in range(0, samples, rows):
        requests = [plan.request(prompt) for _ in range(min(rows, samples - start))]
        for request in requests:
            request.rules += rules
        outputs += decode_batch(models, requests, len(requests))[0]
        totals = sum((request.stats for request in requests), totals)
    return outputs, totals


def chi_square_passes(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Goodness of fit of sampled counts to a distribution, at a false-alarm
    rate of 0.1%; no count may fall outside its support."""
    support, samples = expected > 0, counts.sum()
    assert counts[~support].sum() == 0, "sampled a token the target cannot produce"
    chi2 = (((counts - samples * expected) ** 2)[support] / (samples * expected[support])).sum()
    critical = {7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}[int(support.sum()) - 1]
    return chi2 < critical


# How far past transformers' own float32 error ours may fall. Over 35 random fixtures of the seven families (five seeds
# each) ours over theirs had a median of 0.9 and a largest of 6.3: where a fixture amplifies rounding (a near-constant
# LayerNorm input, a sharp softmax), which of two float32 computations it amplifies more is chance. An error of ours
# is not: M2M-100's position table, once 1.5e-5 off, put its logits ten times as far as transformers'.
ROUNDING_MULTIPLE = 8
SCALE_FLOOR = 1e-4  # and within this fraction of the values' scale always passes: float32 agreement any model reaches
CHANCE_MULTIPLE = 2  # past the farthest of several float32 draws (farthest_float32): the tail of one more draw


def assert_as_near_as_transformers(ours, theirs, exact, what: str = "logits", scale: float | None = None,
                                   chance=None) -> None:
    """Ours (float32) within ROUNDING_MULTIPLE times transformers' own float32
    distance (theirs) from its float64 result (exact), or within SCALE_FLOOR
    of the values' scale (the largest exact value, or `scale`: a few chosen
    logprobs take the whole distribution's): a test that holds on any CPU,
    whatever its BLAS rounds, and fails on an error of ours. `chance`: on a
    fixture that amplifies rounding, the farthest of several float32 draws
    (farthest_float32), which ours may fall CHANCE_MULTIPLE times as far as."""
    ours, theirs, exact = (np.asarray(a, dtype=np.float64) for a in (ours, theirs, exact))
    assert ours.shape == exact.shape == theirs.shape, (ours.shape, theirs.shape, exact.shape)
    scale = np.abs(exact).max() if scale is None else scale
    our_error, their_error = np.abs(ours - exact).max(), np.abs(theirs - exact).max()
    allowed = max(ROUNDING_MULTIPLE * their_error, SCALE_FLOOR * scale)
    if chance is not None:
        allowed = max(allowed, CHANCE_MULTIPLE * np.abs(np.asarray(chance, np.float64) - exact).max())
    assert our_error <= allowed, (f"{what}: ours {our_error:.2e} from float64, transformers' float32 {their_error:.2e} "
                                  f"(scale {scale:.3g}; allowed {allowed:.2e})")
