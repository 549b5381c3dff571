"""The engine's one factory of batches, and the loop that feeds requests through one.

    batch = batch_for(models, settings, batch_size=8)
    for request, token, finish in drive(batch, [Request(ids, settings) for ids in prompts]):
        ...  # finish: None while the row goes on, then "stop" (its end of text) or "length"

The text API (generate.py), the server, the benchmarks and the tests make
every batch here. It imports the batches it makes (decoder.py's, beams.py's)
and the drafters (drafting.py), and none of them imports it: they form no
circle.
"""

from dataclasses import replace
from typing import Iterator

from autodraft import AutoDraft
from beams import BeamBatch
from decoder import RegularBatch, SpeculativeBatch
from rows import Batch, Event, Request
from drafting import DraftModel, LookupDrafter
from options import Decoding, Settings


def batch_for(models, settings: Settings, batch_size: int) -> Batch:
    """The batch that decodes rows of these settings' kind (Settings.kind)
    with `models` (loading.Models: a target, its draft model or None, and
    in `learned.drafting` what num-draft auto has learnt of the pair): the target
    alone, drafts looked up in the prompt, or the draft model's, num_draft
    at a time or as many as auto finds worth it. Rows of that kind at other
    settings may join it: each keeps its own."""
    kind = settings.kind(models)
    if kind.how is Decoding.BEAMS:
        return BeamBatch(models.target, batch_size, kind.beams)
    if kind.how is Decoding.REGULAR:
        return RegularBatch(models.target, batch_size)
    if kind.how is Decoding.LOOKUP:
        drafter = LookupDrafter(models.target.args.vocab_size)
    else:
        auto = None
        if kind.how is Decoding.AUTO_DRAFT:
            auto = models.learned.drafting = models.learned.drafting or AutoDraft()
        drafter = DraftModel(models.draft, auto)
    return SpeculativeBatch(models.target, drafter, batch_size)


def drive(batch: Batch, requests: list[Request], stopped: set[Request] = frozenset()) -> Iterator[Event]:
    """Decode a list of requests through a batch: waiting prompts join as
    rows leave (Batch.joining), in input order. Requests the caller adds to
    `stopped` (their text ended at a stop string) leave at the next round."""
    waiting = list(requests)
    while waiting or batch.rows:
        gone = {row.request for row in batch.rows if row.request in stopped}
        if gone:
            batch.cancel(gone)
        count = batch.joining(len(waiting))
        if count:
            batch.join(waiting[:count])
            waiting = waiting[count:]
        if batch.rows:
            yield from batch.round()


def warm_up(models, ids: list[int], settings: Settings) -> None:
    """A few tokens of each decoding path the settings can take (the target
    alone, and drafting if they draft) on a prompt's ids, so that first-call
    costs (compiling kernels and the steps for its length, growing the
    allocator's pools) stay out of timings and answers."""
    paths = (False, True) if replace(settings, speculative=True).drafts(models) else (False,)
    for speculative in paths:
        short = replace(settings, max_tokens=4, min_tokens=min(settings.min_tokens, 4), speculative=speculative, stop=())
        for _ in drive(batch_for(models, short, 1), [Request(ids, short)]):
            pass
