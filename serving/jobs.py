"""What the engine decodes for one prompt of an HTTP request, and how its text goes back to the request's event loop."""

import asyncio
from dataclasses import dataclass, field

from rows import Request
from serving.metrics import Times
from text import TextStream


@dataclass(eq=False)
class Job:
    """One prompt of one HTTP request: what the engine decodes for it, and the pieces of text it sends back to the
    request's event loop: (text, finish reason, tokens settled so far) a round, then None."""

    request: Request
    stream: TextStream
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: bool = False  # the client left, or a stop string ended the text
    sent_end: bool = False
    error: str | None = None
    times: Times = field(default_factory=Times)
    counted: bool = False  # its end is in the metrics
    beams: list[TextStream] = field(default_factory=list)  # beam search: each beam returned, its text made whole
    status: int = 500  # its error's HTTP status: 400 where its own input failed it
    replay: list[int] = field(default_factory=list)  # tokens its text has, which a replay must decide again first
    passed: int = 0  # later jobs taken while it waited for room in the cache budget (Budget.room_for)

    def accept(self, token: int | None, finish: str | None) -> bool:
        """A decided token into its text; while it replays (Engine.isolate), the tokens its text has already are
        checked, not added. False: the replay decided another token than the text has, and cannot go on."""
        if self.replay and token is not None:
            if token != self.replay.pop(0):
                return False
            token = None
        if finish is not None and self.replay:  # it ended before it had decided its text again
            return False
        if token is not None or finish is not None:
            self.add(token, finish)
        return True

    def add(self, token: int | None, finish: str | None) -> None:
        """A decided token (or the end) into what the job answers: its text."""
        self.stream.add(token, finish)

    @property
    def stats(self):
        return self.request.stats

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.source)

    def ending(self, batch, request: Request) -> None:
        """Its request's last event has come, and its row is still in the batch (it leaves after the round)."""

    def follow(self) -> Request | None:
        """Once its request has ended: the next request the job decodes (an audio file's next window), or None."""
        return None

    @staticmethod
    def encoded(models, cache, jobs: list["Job"]) -> None:
        """What jobs of this kind do once their requests are encoded together into `cache`, before they join."""

    def again(self) -> Request:
        """Its request anew, to decode again from its start (Engine.isolate), with the tokens its text has to replay."""
        old = self.request
        self.replay = list(self.stream.tokens)
        return Request(old.source, old.settings, opening=old.opening, rules=old.rules, key=old.key,
                       ruled_logprobs=old.ruled_logprobs)

    def cancel(self) -> None:
        """Its caller is gone: the row leaves at the next round (a job whose text has ended stays as it is)."""
        self.cancelled = self.cancelled or self.stream.finish_reason is None

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def publish(self) -> None:
        """After a round: the text that can go out (one piece a round, however many tokens it took), and its end."""
        if self.sent_end:
            return
        ready, finish = self.stream.take(), self.stream.finish_reason
        if ready or finish:
            self.send((ready, finish, self.stream.settled))
        if finish:
            self.end()

    def end(self) -> None:
        """Whoever still waits on the job stops waiting."""
        if not self.sent_end:
            self.sent_end = True
            self.send(None)

    def fail(self, message: str, status: int = 500) -> None:
        self.error, self.status = message, status
        self.end()
