"""The text stream the API and the server share: stop strings held back and cut, the finish reason, and the
tokens the caller received."""

import random

import pytest

from text import TextStream


class Pieces:
    """A tokenizer whose token i decodes to pieces[i]."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, **options) -> str:
        return "".join(self.pieces[i] for i in ids)


def run(stream: TextStream, tokens: list[int], finish: str = "stop") -> list[str]:
    """What take() gives after each token, the engine finishing at the last."""
    taken = []
    for i, token in enumerate(tokens):
        stream.add(token, finish if i == len(tokens) - 1 else None)
        taken.append(stream.take())
        if stream.finish_reason:
            break
    return taken


def test_a_stop_string_split_over_tokens_is_held_back_then_cut():
    tokenizer = Pieces(["def", " f", "(x", "):", "\n", "  return", " x"])
    stream = TextStream(tokenizer, stop=("):\n",))
    taken = run(stream, [0, 1, 2, 3, 4, 5, 6], finish="length")
    assert taken == ["def", " f", "(x", "", ""]  # "):" might begin the stop string: held, then cut with it
    assert stream.finish_reason == "stop" and stream.received == 3  # "):" begins the stop string: not received
    assert stream.text_tokens == [0, 1, 2]
    stream = TextStream(tokenizer, stop=(":\n",))
    assert run(stream, [0, 1, 2, 3, 4], finish="length") == ["def", " f", "(x", ")", ""]
    assert stream.received == 4  # "):" began before the cut: its token counts


def test_text_that_only_looked_like_a_stop_string_goes_out_once_it_cannot_be_one():
    stream = TextStream(Pieces(["a", "b", "c", "x"]), stop=("abd",))
    assert run(stream, [0, 1, 2, 3], finish="length") == ["", "", "abc", "x"]
    assert stream.finish_reason == "length" and stream.received == 4


def test_without_a_stop_string_the_engines_reason_ends_the_text_and_every_token_counts():
    stream = TextStream(Pieces(["x", "y"]))
    assert run(stream, [0, 1], finish="stop") == ["x", "y"] and (stream.finish_reason, stream.received) == ("stop", 2)
    stream = TextStream(Pieces(["x", "y"]), stop=("y",))
    stream.add(None, "stop")  # the end of text came first: nothing at all
    assert (stream.take(), stream.finish_reason, stream.received) == ("", "stop", 0)


def test_tokens_after_the_stop_string_change_nothing():
    stream = TextStream(Pieces(["a", "STOP", "b"]), stop=("STOP",))
    stream.add(0)
    stream.add(1)
    stream.add(2, "length")
    assert (stream.take(), stream.finish_reason, stream.received) == ("a", "stop", 1)


@pytest.mark.parametrize("seed", range(200))
def test_the_text_taken_is_the_whole_text_cut_at_its_first_stop_string(seed):
    """Random pieces over a small alphabet and random stop strings: the
    pieces taken join to the decoded text up to its earliest stop string
    (all of it when there is none), and the tokens received are those whose
    text began before that."""
    rng = random.Random(seed)
    pieces = ["".join(rng.choice("ab c") for _ in range(rng.randrange(0, 4))) for _ in range(12)]
    stops = tuple({"".join(rng.choice("ab c") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(0, 4))})
    tokens = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 30))]
    stream, settled = TextStream(Pieces(pieces), stops), []
    taken = ""
    for i, token in enumerate(tokens):
        stream.add(token, "length" if i == len(tokens) - 1 else None)
        taken += stream.take()
        settled.append(stream.settled)
        if stream.finish_reason:
            break
    assert settled == sorted(settled) and settled[-1] == stream.received  # no token given out is cut later
    whole = "".join(pieces[t] for t in tokens)
    found = [whole.find(stop) for stop in stops if stop in whole]
    cut = min(found) if found else len(whole)
    assert taken == whole[:cut]
    assert stream.finish_reason == ("stop" if found else "length")
    starts = [len("".join(pieces[t] for t in tokens[:i])) for i in range(len(tokens))]
    assert stream.received == (sum(start < cut for start in starts) if found else len(tokens))


def test_a_count_reads_as_a_person_writes_it():
    """Not "1 prompts" or "1 decode steps", as the command line once printed."""
    from text import plural

    assert [plural(n, "prompt") for n in (0, 1, 2, 1024)] == ["0 prompts", "1 prompt", "2 prompts", "1,024 prompts"]
    assert plural(1, "pass", "passes") == "1 pass" and plural(3, "pass", "passes") == "3 passes"


def test_a_statistics_line_of_one_reads_in_the_singular():
    from display import stats_line
    from options import Stats

    line = stats_line(Stats(prompt_tokens=1, generated=1, target_calls=1, drafted=1, accepted=1, seconds=0.5), True)
    assert "1 / 1 draft (" in line and "1 decode step (" in line and "1 token in" in line and "prompt 1 token encoded" in line
