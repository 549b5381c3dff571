"""The benchmarks' harness and their CTranslate2 baseline: contenders alternate, results name their command, and
CTranslate2 decodes our checkpoints to our greedy tokens."""

import pytest

from bench.harness import alternate, command_line, decode, same_tokens
from bench.references import CT2Worker, ct2_installed, intel_openmp
from loading import Models, load_model
from options import Settings

needs_ct2 = pytest.mark.skipif(not ct2_installed(), reason="CTranslate2 is a benchmark reference (pip install ctranslate2)")


def test_alternate_warms_each_contender_until_steady_then_runs_them_in_turn_and_takes_medians():
    """A contender cold for two whole runs (as transformers was on an Intel
    Xeon) warms until two runs in a row agree, one warm at once after two;
    neither's warm-up counts."""
    calls, seconds = [], {"a": iter([9.0, 1.0, 1.1, 1.0, 5.0, 3.0]), "b": iter([30.0, 20.0, 2.1, 2.0, 2.0, 2.0, 8.0])}

    def contender(name):
        def run():
            calls.append(name)
            return next(seconds[name]), f"{name}{len(calls)}"
        return run

    timings = alternate({"a": contender("a"), "b": contender("b")}, repeats=3)
    assert calls == ["a"] * 3 + ["b"] * 4 + ["a", "b"] * 3  # the warm-ups, then three passes in turn
    assert (timings["a"].warm_ups, timings["b"].warm_ups) == (3, 4)
    assert (timings["a"].median, timings["b"].median) == (3.0, 2.0)
    assert timings["a"].seconds == [1.0, 5.0, 3.0] and timings["b"].output == "b13"


def test_a_contender_that_never_steadies_is_timed_after_the_most_warm_ups():
    from bench.harness import MOST_WARM_UPS, warm_until_steady

    times = iter([1.0, 2.0] * MOST_WARM_UPS)
    assert warm_until_steady(lambda: (next(times), None)) == MOST_WARM_UPS


def test_a_result_names_the_command_as_typed_without_where_checkpoints_live():
    assert command_line(["steps", "--dir", "/tmp/x", "--shapes", "deep,large", "--dir=/y"]) == \
        "python -m bench steps --shapes deep,large"


def ctranslate2_decodes_our_greedy_tokens(checkpoint, tmp_path, intel_openmp_runtime: bool) -> None:
    """In float32, to EOS; a forced length (as the speed runs ask) is kept to."""
    model = load_model(checkpoint.mlx_dir)
    ours, _, _ = decode(Models(model), [checkpoint.prompt_ids], Settings(max_tokens=24, speculative=False))
    worker = CT2Worker(checkpoint.hf_dir, "float32", tmp_path, intel_openmp_runtime)
    try:
        assert same_tokens(ours, {"fp32": worker}, [checkpoint.prompt_ids], 24) == {"fp32": 0}
        assert len(worker.run(checkpoint.prompt_ids, 30, min_tokens=30)["tokens"]) == 30
    finally:
        worker.close()


@needs_ct2
def test_ctranslate2_decodes_each_flavour_to_our_greedy_tokens(checkpoint, tmp_path):
    ctranslate2_decodes_our_greedy_tokens(checkpoint, tmp_path, intel_openmp_runtime=False)


@needs_ct2
def test_ctranslate2_on_intels_openmp_decodes_our_greedy_tokens(v1_1_checkpoint, tmp_path):
    """The bench's second CTranslate2 run, Intel's OpenMP runtime preloaded (the runtime, not the flavour, is what
    this run changes: one flavour)."""
    if intel_openmp() is None:
        pytest.skip("intel-openmp is not installed")
    ctranslate2_decodes_our_greedy_tokens(v1_1_checkpoint, tmp_path, intel_openmp_runtime=True)


def test_the_whisper_benchmarks_transformers_worker_transcribes_as_we_do_at_tiny_shapes(tmp_path):
    """`bench whisper`'s checkpoint (Whisper tiny's shapes, its real vocabulary, suppressed tokens and rules, random
    weights) and its transformers worker, which calls generate as a user does: 30 s of espeak-ng's speech
    (short-form, no timestamps) and 70 s (three long-form windows with timestamps, where the bench's 5 minutes have ten)
    give our tokens, many distinct."""
    import shutil

    from bench import speech
    from bench.harness import Worker
    from checkpoints import openai_whisper_tokenizer
    from loading import load

    if shutil.which("espeak-ng") is None or openai_whisper_tokenizer() is None:
        pytest.skip("espeak-ng, mlx-whisper and tiktoken (CI installs them) make the speech and the vocabulary")
    import speech as ours

    files = speech.speech(tmp_path / "speech", (30, 70))
    hf, mlx = speech.checkpoint(tmp_path, "tiny")
    models, worker = load(str(mlx), one_row=True), Worker("--whisper-worker", str(hf), "--whisper-reference",
                                                          "transformers")
    try:
        for seconds, path in files.items():
            (transcription,) = ours.transcribe(models, [path], language="en", max_tokens=40)
            assert worker.ask({"file": str(path), "tokens": 40})["tokens"] == transcription.tokens
            assert len(set(transcription.tokens)) >= 10 and len(transcription.tokens) >= (40 if seconds == 30 else 80)
    finally:
        worker.close()


@pytest.mark.parametrize("reference", ["mlx-whisper", "faster-whisper float32"])
def test_the_whisper_benchmarks_other_references_read_its_checkpoint_in_their_own_layouts(tmp_path, reference):
    """mlx-whisper (openai-whisper's weight names, MLX's convolution layout) and faster-whisper (CTranslate2's
    conversion) on `bench whisper`'s checkpoint: 30 s of speech, their first 10 tokens ours (their features are
    computed otherwise; later tokens may part at a random model's near-ties), each worker as the bench runs it."""
    import importlib.util
    import shutil

    from bench import speech
    from bench.harness import Worker
    from checkpoints import openai_whisper_tokenizer
    from loading import load

    package = {"mlx-whisper": "mlx_whisper", "faster-whisper float32": "faster_whisper"}[reference]
    if shutil.which("espeak-ng") is None or openai_whisper_tokenizer() is None or \
            importlib.util.find_spec(package) is None:
        pytest.skip(f"espeak-ng, tiktoken and {reference.split()[0]} (CI installs them)")
    import speech as ours

    path = speech.speech(tmp_path / "speech")[30]
    hf, mlx = speech.checkpoint(tmp_path, "tiny")
    worker = Worker("--whisper-worker", str(speech.reference_folder(hf, reference)), "--whisper-reference", reference)
    try:
        (transcription,) = ours.transcribe(load(str(mlx), one_row=True), [path], language="en", max_tokens=20)
        assert worker.ask({"file": str(path), "tokens": 20})["tokens"][:10] == transcription.tokens[:10]
        assert len(set(transcription.tokens[:10])) >= 8
    finally:
        worker.close()


def test_the_serve_benchs_client_reads_streamed_completions_as_the_server_counts_them():
    """bench serve's load generator (a hand-written HTTP/1.1 client): over one kept-alive connection, each streamed
    completion's tokens are what the same request answers whole, its first text comes before its end, and a request
    the server refuses raises with the server's message."""
    import asyncio

    import httpx

    from bench.harness import DEMO
    from bench.serve import Connection
    from serving.process import ServerProcess

    server = ServerProcess("--model", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"))
    bodies = [{"model": "default", "prompt": prompt, "max_tokens": tokens, "num_draft": 3}
              for prompt, tokens in (("def add(a, b):", 20), ("import os", 7), ("class Point:", 30))]

    async def streamed():
        connection = Connection(server.url)
        try:
            answers = [await connection.completion(body) for body in bodies]
            try:
                await connection.completion({**bodies[0], "max_tokens": 0})
            except RuntimeError as e:
                return answers, str(e)
            return answers, None
        finally:
            connection.close()

    try:
        answers, refusal = asyncio.run(streamed())
        whole = [httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"]
                 for body in bodies]
    finally:
        server.stop()
    assert [answer["tokens"] for answer in answers] == whole and all(n > 0 for n in whole)
    assert all(0 < answer["first"] <= answer["latency"] for answer in answers)
    assert refusal is not None and "400" in refusal and "max_tokens" in refusal


def test_whisper_profile_splits_a_token():
    """A token's time is the whole less what comes before the first token, over the tokens. Ours is split into a
    step less the head (the steps, less the cross-attention keys and values they built, over the opening's pass
    and each token's) and the rest (the whole's decoding less the steps, over the tokens): milliseconds as rendered."""
    from bench.speech_profile import render_whisper_profile

    ours = {"tokens": 9, "read": 0.001, "features": 0.01, "stem": 0.02, "encoder": 0.5, "cross": 0.04,
            "steps": 0.13, "head": 0.002, "whole": 0.731}  # a step 9 ms, a token 20 ms, the rest 10 ms
    theirs = {"tokens": 10, "read": 0.001, "features": 0.009, "encoder": 0.3, "head": 0.002, "whole": 0.51}
    text = render_whisper_profile({"repeats": 3, "window_tokens": 224, "versions": {"transformers": "transformers 5"},
                                   "rows": [{"model": "tiny.en", "parts": {"ours": ours, "transformers": theirs}}]})
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ours") or line.startswith("| transformers")]
    assert rows[0][1:] == ["9", "1.0", "10.0", "20.0", "480.0", "40.0", "20.0", "7.0", "2.0", "10.0", "731.0 |"]
    assert rows[1][1:] == ["10", "1.0", "9.0", "-", "300.0", "-", "20.0", "-", "2.0", "-", "510.0 |"]
    assert "References: transformers 5." in text
