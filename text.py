"""From decided tokens to the text a caller receives: one `TextStream` per prompt, for the API and the server alike.

    stream = TextStream.of(tokenizer, settings)
    for request, token, finish in drive(batch, [request]):
        stream.add(token, finish)
        send(stream.take())               # the text that can go out now
        if stream.finish_reason: break    # "stop" (end of text, or a stop string) or "length"
    stream.received                       # the tokens whose text the caller received (usage)

The engine's statistics (options.Stats) count what it decoded, which may run
past a stop string to the end of that round; `received` counts what the
caller got.
"""

import bisect


class Detokenizer:
    """Text from token ids as they come, equal to decoding them all at once.

    Each token decodes a short window: the tokens since the last piece of
    text was settled, twice (with and without the new ones). The difference
    is the new text, held back while it ends in an incomplete character. The
    window restarts after every emitted piece, so the work per token follows
    the new piece, not the length of the output. Decoding never "cleans up"
    spaces before punctuation (an old transformers default, off since v5):
    that would take back a space already shown."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        # Skipped special tokens decode to nothing and change nothing around them: they never enter the window
        # (which would otherwise never settle over a run of them, each decoding the run again).
        self.skipped = special_ids(tokenizer) if skip_special_tokens else frozenset()
        self.tokens = []
        self.start = 0  # first token of the window
        self.settled = 0  # tokens already turned into emitted text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """The text this token adds; "" while it is held back."""
        if token in self.skipped:
            return ""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.start : self.settled])
        after = self.decode(self.tokens[self.start :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.start, self.settled = self.settled, len(self.tokens)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as \ufffd)."""
        before = self.decode(self.tokens[self.start : self.settled])
        after = self.decode(self.tokens[self.start :])
        self.start = self.settled = len(self.tokens)
        return after[len(before) :]


def special_ids(tokenizer) -> frozenset[int]:
    """The ids a tokenizer's decode leaves out with skip_special_tokens (loading's tokenizers, or transformers')."""
    if hasattr(tokenizer, "special_ids"):
        return frozenset(tokenizer.special_ids())
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class StopStrings:
    """Where stop strings appear in a text fed piece by piece, in time linear
    in the text whatever their lengths: each keeps the length of its longest
    prefix that ends the text so far (Knuth, Morris and Pratt's automaton), so
    that a character costs O(1) steps amortized, and `partial` (the most of
    the text's end that may begin a stop string) is known without searching."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fallbacks = [fallbacks(stop) for stop in stops]
        self.matched = [0] * len(stops)  # each stop's longest prefix that ends the text
        self.length = 0  # characters fed

    def feed(self, text: str) -> int | None:
        """Feed text; where (in the whole text fed) the earliest stop string that ends in it begins, or None."""
        found = None
        for at, character in enumerate(text, self.length + 1):  # at: the text's length with this character
            for i, stop in enumerate(self.stops):
                k = self.matched[i]
                while k and (k == len(stop) or stop[k] != character):
                    k = self.fallbacks[i][k - 1]
                k += stop[k] == character
                self.matched[i] = k
                if k == len(stop) and (found is None or at - k < found):
                    found = at - k
        self.length += len(text)
        return found

    @property
    def partial(self) -> int:
        """Characters at the text's end that may be the start of a stop string."""
        return max((k for k, stop in zip(self.matched, self.stops) if k < len(stop)), default=0)


def fallbacks(pattern: str) -> list[int]:
    """Knuth-Morris-Pratt's table: for each prefix, the length of its longest proper prefix that is also its suffix."""
    table, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        k += pattern[i] == pattern[k]
        table[i] = k
    return table


def token_text(tokenizer, before: list[int], token: int, skip_special_tokens: bool = False) -> str:
    """The text a token adds after the tokens `before` it (a few are enough:
    a SentencePiece token's leading space shows only after another token)."""
    context = before[-4:]
    shown = tokenizer.decode(context, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    whole = tokenizer.decode(context + [token], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    return whole[len(shown) :]


class TextStream:
    """One prompt's text as the engine decides its tokens (decoder.Event's
    token and finish reason, through `add`).

    `take` gives the text that can go out now: all of it but a tail that may
    be the start of a stop string, held back until it cannot be. The first
    stop string to appear ends the text before it, with finish_reason "stop";
    later tokens change nothing (the caller drops the row). Otherwise the
    engine's reason ends it: "stop" at the end of text, "length" at
    max_tokens. `received` counts the tokens whose text the caller gets: all
    of them, or, after a stop string, those whose text began before it."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = False):
        self.detokenizer = Detokenizer(tokenizer, skip_special_tokens)
        self.stop = tuple(stop)
        self.stops = StopStrings(self.stop)
        self.tokens: list[int] = []
        self.starts: list[int] = []  # where each token's text begins in the whole text
        self.pending = ""  # decided text not taken yet
        self.taken = 0  # characters taken so far
        self.cut: int | None = None  # the whole text's length, once a stop string ended it
        self.finish_reason: str | None = None

    @classmethod
    def of(cls, tokenizer, settings) -> "TextStream":
        """The stream a generation at these Settings (options.py) writes: its stop strings, its special tokens kept or not."""
        return cls(tokenizer, settings.stop, settings.skip_special_tokens)

    def add(self, token: int | None, finish: str | None = None) -> None:
        if self.finish_reason is not None:
            return
        new = ""
        if token is not None:
            self.tokens.append(token)
            self.starts.append(self.taken + len(self.pending))
            new = self.detokenizer.add(token)
        if finish is not None:
            new += self.detokenizer.flush()
        self.pending += new
        found = self.stops.feed(new) if self.stop else None
        if found is not None:  # the earliest stop string: it begins in the pending text, as a stop's start is never taken
            self.pending = self.pending[: found - self.taken]
            self.cut, self.finish_reason = found, "stop"
        elif finish is not None:
            self.finish_reason = finish

    def whole(self, tokens: list[int], finish: str) -> str:
        """The text of a whole output at once (a beam search's beams)."""
        for token in tokens:
            self.add(token)
        self.add(None, finish)
        return self.take()

    def take(self) -> str:
        """The text that can go out now: after the end, all that is left."""
        held = self.stops.partial if self.finish_reason is None else 0
        ready, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        self.taken += len(ready)
        return ready

    @property
    def received(self) -> int:
        if self.cut is None:
            return len(self.tokens)
        return bisect.bisect_left(self.starts, self.cut)

    @property
    def settled(self) -> int:
        """Tokens no stop string can cut any more: all of them without stop
        strings; else those whose text began in the text taken (a stop
        string never begins there), and after the end every token received."""
        if not self.stop or self.finish_reason is not None:
            return self.received
        return bisect.bisect_left(self.starts, self.taken)

    @property
    def text_tokens(self) -> list[int]:
        """The tokens the caller receives (`received` of them)."""
        return self.tokens[: self.received]


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """A count and its noun as a person writes them: "1 prompt", "2 prompts", "1,024 tokens", "3 passes" (nouns)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
