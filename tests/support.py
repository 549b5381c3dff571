"""What the tests share: token ids decoded through the engine's one factory, and one chi-square check."""

import numpy as np

from decoder import Request, batch_for, drive
from loading import Models
from options import Settings, Stats


def decode(models: Models, prompt: list[int], settings: Settings = Settings(), stats: Stats | None = None) -> list[int]:
    """One prompt's token ids, decoded as `generate` decodes it: a batch of one."""
    request = Request(prompt, settings, stats if stats is not None else Stats())
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


def chi_square_passes(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Goodness of fit of sampled counts to a distribution, at a false-alarm
    rate of 0.1%; no count may fall outside its support."""
    support, samples = expected > 0, counts.sum()
    assert counts[~support].sum() == 0, "sampled a token the target cannot produce"
    chi2 = (((counts - samples * expected) ** 2)[support] / (samples * expected[support])).sum()
    critical = {7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}[int(support.sum()) - 1]
    return chi2 < critical
