"""Session fixtures: a local tokenizer and converted random checkpoints of each T5 flavour."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "demo")]

import convert  # noqa: E402
import cpu  # noqa: E402
from checkpoints import PROMPT, make_checkpoint, perturbed_copy, t5_config, train_tokenizer  # noqa: E402
import mlx.core as mx  # noqa: E402
from loading import load_model  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

# name -> (config, separate lm_head, seed). Seeds were picked so that greedy
# output is varied rather than one repeated token, and each greedy choice wins
# by more than float32 noise (test_model.py asserts both).
FLAVOURS = {
    "v1_0_tied": (t5_config(), False, 10),
    "v1_1_gated_untied": (t5_config(feed_forward_proj="gated-gelu"), True, 5),
    "deeper_decoder": (t5_config(num_layers=1, num_decoder_layers=3), False, 3),
    "many_heads": (t5_config(num_heads=16, d_kv=8), True, 4),
}


# The second pass, T5_MLX_PATH=accelerator, runs every test whose subject the
# path changes: parity with transformers, speculative and batched exactness,
# quantized models, long prompts, compiled steps, attention, Whisper, the API
# and the CLI. These it leaves to the first: the benchmarks' harness,
# conversion, the BLAS and the split products, the demo's training and
# quality, float16's clamp, the server (serving/ has no branch of its own on
# the path; every line its tests ran on the accelerator's path, the tests kept
# ran too, or they on the CPU's: a coverage comparison), text, the vocabulary
# and the tokenizers a conversion writes, the entry points' --help,
# the docs and the layout, and the statistical tests of the sampling rule (its
# arithmetic runs after the model's, the same on both paths), and faster-whisper's agreement with real weights
# (ours is held to transformers' on both paths by the tests before it). Of the real weights, the second pass takes
# tiny.en's tests: base takes the branches tiny.en takes (the same layers, wider), and its multilingual ones
# (detection, translation) are rules over the logits; its tests, a third of the pass's time (MLX's fused attention and
# GELU run the encoder 3x slower on the CPU than the CPU path's own), run in the first. So do the speech demo's (its
# draft's head and borrowed encoder take no branch of the path: test_drafting's head tests take the head on both),
# and Whisper's tests of rules over the logits (CPU_PASS_TESTS), whose model the tests kept on the path run in every
# configuration the rules put it in: a file, files of several lengths together, timestamps, long form, beams, drafts,
# word times.
CPU_PASS_ONLY = {"test_bench.py", "test_convert.py", "test_cpu.py", "test_demo.py", "test_train.py", "test_float16.py",
                 "test_train_speech.py", "test_demo_speech.py",
                 "test_server.py", "test_server_budget.py", "test_server_limits.py", "test_server_load.py",
                 "test_server_robust.py",
                 "test_server_scheduling.py", "test_text.py", "test_whisper_vocabulary.py", "test_docs.py",
                 "test_structure.py", "test_pipeline.py"}
CPU_PASS_NAMES = ("distribution", "faster_whisper", "convert_to_one_tokenizer", "prints_its_help")
CPU_PASS_TESTS = {  # test_whisper.py's rules: language detection, fallbacks and skips, openings, lengths, output
    "test_without_a_language_the_spoken_one_is_detected_as_transformers_detects_it",
    "test_by_default_the_output_takes_the_positions_the_opening_leaves",
    "test_a_window_failing_a_threshold_is_decoded_again_at_the_next_temperature",
    "test_a_beam_searched_window_that_fails_a_threshold_is_sampled_again_with_one_beam",
    "test_the_windows_figures_are_transformers_and_a_silent_window_is_skipped_by_its_threshold",
    "test_a_file_of_silence_whose_every_window_is_skipped_has_no_segments",
    "test_conditioned_on_the_text_before_each_window_opens_as_transformers_condition_on_prev_tokens",
    "test_a_prompt_opens_every_window_as_transformers_prompt_ids_do",
    "test_a_long_file_beam_searched_is_transformers_long_form_with_its_words",
    "test_a_files_segments_stream_as_their_closing_timestamps_are_decided",
    "test_the_command_line_transcribes_files_and_prints_openais_verbose_json",
    "test_the_command_line_prints_a_files_segments_as_they_are_decided_with_the_guards_it_is_given",
    "test_the_command_line_writes_subtitles_beside_each_other_in_a_folder",
    "test_the_command_line_prints_each_words_times_under_its_segment",
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get(cpu.PATH_SETTING, "").strip().lower() != "accelerator":
        return
    skip = pytest.mark.skip(reason="not path-dependent: run in the CPU path's pass")
    tiny_en_takes_it = pytest.mark.skip(reason="tiny.en takes base's branches on this path: run in the CPU path's pass")
    for item in items:
        serves = "server" in item.name or {"server", "audio_server"} & set(item.fixturenames)  # (Whisper's endpoints)
        if item.path.name in CPU_PASS_ONLY or serves or any(part in item.name for part in CPU_PASS_NAMES) or \
                item.originalname in CPU_PASS_TESTS:
            item.add_marker(skip)
        elif item.path.name == "test_whisper_real.py" and "[base]" in item.name:
            item.add_marker(tiny_en_takes_it)


class Checkpoint:
    """A Hugging Face checkpoint, its transformers model and its MLX conversion."""

    def __init__(self, name, hf_dir, mlx_dir, hf_model, tokenizer):
        self.name, self.hf_dir, self.mlx_dir, self.hf_model, self.tokenizer = name, hf_dir, mlx_dir, hf_model, tokenizer
        self.prompt_ids = tokenizer(PROMPT).input_ids


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def build(name, tmp_path_factory, tokenizer_dir, tokenizer, initializer_factor=None) -> Checkpoint:
    config, untied, seed = FLAVOURS[name]
    if initializer_factor is not None:
        config = t5_config(**{**config.to_dict(), "initializer_factor": initializer_factor})
    root = tmp_path_factory.mktemp(name)
    hf_model = make_checkpoint(root / "hf", config, seed, tokenizer_dir, untied_head=untied)
    convert.convert(str(root / "hf"), root / "mlx", "float32", force=False)
    return Checkpoint(name, root / "hf", root / "mlx", hf_model, tokenizer)


@pytest.fixture(scope="session", params=list(FLAVOURS))
def checkpoint(request, tmp_path_factory, tokenizer_dir, tokenizer) -> Checkpoint:
    return build(request.param, tmp_path_factory, tokenizer_dir, tokenizer)


@pytest.fixture(scope="session", params=list(FLAVOURS))
def unit_scale_checkpoint(request, tmp_path_factory, tokenizer_dir, tokenizer) -> Checkpoint:
    """initializer_factor 1: values of order one, where float32 agreement to 1e-4
    is meaningful (at factor 10 attention scores are so large that summation
    order alone moves the softmax by ~1e-4 per layer)."""
    return build(request.param, tmp_path_factory, tokenizer_dir, tokenizer, initializer_factor=1.0)


@pytest.fixture(scope="session")
def v1_1_checkpoint(tmp_path_factory, tokenizer_dir, tokenizer) -> Checkpoint:
    return build("v1_1_gated_untied", tmp_path_factory, tokenizer_dir, tokenizer)


@pytest.fixture(scope="session")
def checkpoint_by_name(tmp_path_factory, tokenizer_dir, tokenizer):
    """build(name), once per session per name."""
    built = {}

    def get(name: str) -> Checkpoint:
        if name not in built:
            built[name] = build(name, tmp_path_factory, tokenizer_dir, tokenizer)
        return built[name]

    return get


@pytest.fixture(scope="session")
def pair(v1_1_checkpoint, checkpoint_by_name, tmp_path_factory):
    """The target and three drafts: itself, a close copy, and an unrelated model."""
    root = tmp_path_factory.mktemp("drafts")
    # initializer_factor 10 makes the target chaotic: 0.1% noise already costs
    # about a third of the drafts.
    close = perturbed_copy(v1_1_checkpoint.hf_dir, root / "close-hf", noise=0.001, seed=0)
    convert.convert(str(close), root / "close", "float32", force=False)
    return {
        "target": load_model(v1_1_checkpoint.mlx_dir),
        "drafts": {
            "same": load_model(v1_1_checkpoint.mlx_dir),
            "close": load_model(root / "close"),
            "unrelated": load_model(checkpoint_by_name("v1_0_tied").mlx_dir),
        },
        "checkpoint": v1_1_checkpoint,
    }


@pytest.fixture(scope="session")
def unit_scale_pair(tmp_path_factory, tokenizer_dir):
    """initializer_factor 1: the target's distributions are spread out, so
    delta changes what it accepts (at factor 10 they are one-hot)."""
    root = tmp_path_factory.mktemp("unit-scale-pair")
    config = t5_config(feed_forward_proj="gated-gelu", initializer_factor=1.0)
    make_checkpoint(root / "target-hf", config, 5, tokenizer_dir, untied_head=True)
    perturbed_copy(root / "target-hf", root / "draft-hf", noise=0.05, seed=0)
    for name in ("target", "draft"):
        convert.convert(str(root / f"{name}-hf"), root / name, "float32", force=False)
    return load_model(root / "target"), load_model(root / "draft")


@pytest.fixture(scope="session")
def tiny_vocab_pair(tmp_path_factory, tokenizer_dir):
    """Target and draft over 8 tokens, with spread-out and different distributions."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    models = {}
    for name, seed in (("target", 0), ("draft", 1)):
        hf = make_checkpoint(root / f"{name}-hf", t5_config(vocab_size=8, initializer_factor=1.0), seed, tokenizer_dir)
        convert.convert(str(root / f"{name}-hf"), root / name, "float32", force=False)
        models[name] = (load_model(root / name), hf)
    return models


class EosAt:
    """Wraps a model so that its favourite token at decoder position `position` is EOS, in every row."""

    def __init__(self, model, position):
        self.model, self.position, self.args = model, position, model.args

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode(self, tokens, cache):
        positions = mx.array(cache.offsets)[:, None, None] + mx.arange(tokens.shape[1])[None, :, None]
        logits = self.model.decode(tokens, cache)
        is_eos = mx.arange(logits.shape[-1])[None, None, :] == self.args.eos_token_id
        return mx.where((positions == self.position) & is_eos, logits.max() + 100.0, logits)


@pytest.fixture
def eos_at():
    """EosAt(model, position): a model whose favourite token at that decoder position is EOS."""
    return EosAt


@pytest.fixture(scope="session")
def demo_models():
    """The demo pair (demo/target with demo/draft), loaded once."""
    from loading import load

    return load(ROOT / "demo" / "target", draft=ROOT / "demo" / "draft")


@pytest.fixture(scope="session")
def demo_prompts():
    """The demo's held-out prompts."""
    import main

    return main.demo_prompts()
