"""Task presets: a task the model's config names (task_specific_params) gives its prompt prefix and decoding
options, as transformers' pipelines apply them; options given explicitly override them, in every front end."""

import io
import json
import shutil

import httpx
import pytest
import torch
from checkpoints import PROMPT

import main
from errors import OptionError
from generate import batch_generate, generate
from interactive import Session
from loading import load
from options import Settings, task_preset
from serving.process import ServerProcess

# t5-small's own presets, with lengths cut to fit a test
TASKS = {"summarization": {"early_stopping": True, "length_penalty": 2.0, "max_length": 25, "min_length": 12,
                           "no_repeat_ngram_size": 3, "num_beams": 4, "prefix": "summarize: "},
         "translation_en_to_de": {"early_stopping": True, "max_length": 20, "num_beams": 4,
                                  "prefix": "translate English to German: "}}


@pytest.fixture(scope="module")
def tasked(unit_scale_checkpoint, tmp_path_factory):
    """The checkpoint's conversion with t5-small's task_specific_params in its config."""
    checkpoint = unit_scale_checkpoint
    folder = tmp_path_factory.mktemp("tasked") / "mlx"
    shutil.copytree(checkpoint.mlx_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"task_specific_params": TASKS}))
    return checkpoint, folder


def transformers_task(checkpoint, task: str, prompt: str, **overrides) -> str:
    params = {k: v for k, v in TASKS[task].items() if k != "prefix"} | overrides
    ids = checkpoint.tokenizer(TASKS[task]["prefix"] + prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = checkpoint.hf_model.generate(ids, do_sample=False, **params)
    return checkpoint.tokenizer.decode(out[0, 1:], skip_special_tokens=True)


def test_a_preset_maps_transformers_lengths_to_tokens_generated():
    prefix, options = task_preset(TASKS, "summarization")
    assert prefix == "summarize: "
    assert options == dict(early_stopping=True, length_penalty=2.0, max_tokens=24, min_tokens=11, no_repeat_ngram_size=3,
                           num_beams=4)
    with pytest.raises(OptionError, match="names no task 'sumarization' \\(its tasks: summarization, translation_en_to_de\\)"):
        task_preset(TASKS, "sumarization")


@pytest.mark.parametrize("task", list(TASKS))
def test_a_task_decodes_as_transformers_does_with_its_parameters(tasked, task):
    checkpoint, folder = tasked
    if checkpoint.hf_model.config.num_decoder_layers > checkpoint.hf_model.config.num_layers:
        pytest.skip("transformers' generate() breaks when the decoder is deeper than the encoder")
    models = load(folder)
    ours = generate(models, PROMPT, task=task, skip_special_tokens=True)
    assert ours == transformers_task(checkpoint, task, PROMPT)
    # an option given overrides the task's: one beam, the other options kept
    assert generate(models, PROMPT, task=task, num_beams=1, skip_special_tokens=True) == \
        transformers_task(checkpoint, task, PROMPT, num_beams=1)
    assert batch_generate(models, [PROMPT], task=task, skip_special_tokens=True)[0].text == ours


def test_the_command_line_the_loop_and_the_server_take_a_task(tasked, capsys):
    checkpoint, folder = tasked
    models = load(folder)
    expected = generate(models, PROMPT, task="summarization", max_tokens=15)
    assert main.main(["--model", str(folder), "--regular-decode", "--json", "--prompt", PROMPT, "--task", "summarization",
                      "--max-tokens", "15"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == expected
    assert main.main(["--model", str(folder), "--regular-decode", "--task", "poetry"]) == 2
    assert "its tasks: summarization, translation_en_to_de" in capsys.readouterr().err

    out = io.StringIO()
    session = Session(models, Settings(speculative=False), out=out)
    session.command(":task summarization")
    session.command(":max-tokens 15")
    assert session.settings.num_beams == 4 and session.prefix == "summarize: "
    session.generate(PROMPT)
    assert expected in out.getvalue()
    session.command(":task none")  # the task's options go back, but what a command set since stays
    assert session.prefix == "" and session.settings == Settings(speculative=False, max_tokens=15)
    session = Session(models, Settings(num_draft="auto"), out=out)
    session.command(":task summarization")  # beams refuse num-draft auto: nothing changes
    assert session.prefix == "" and session.settings == Settings(num_draft="auto")
    assert "does not take num-draft auto" in out.getvalue()

    # a server that samples by default: a task's beams (and use_beam_search's) search greedily all the same
    server = ServerProcess("--model", str(folder), "--served-model-name", "t", "--temp", "0.7")
    try:
        reply = httpx.post(server.url + "/v1/completions", json={"model": "t", "prompt": PROMPT, "task": "summarization",
                                                                 "max_tokens": 15, "skip_special_tokens": False}).json()
        assert reply["choices"][0]["text"] == expected
        beams = httpx.post(server.url + "/v1/completions", json={"model": "t", "prompt": PROMPT, "use_beam_search": True,
                                                                 "best_of": 3, "max_tokens": 10}).json()
        assert beams["choices"][0]["text"] == generate(models, PROMPT, num_beams=3, max_tokens=10, skip_special_tokens=True)
        refused = httpx.post(server.url + "/v1/completions", json={"model": "t", "prompt": PROMPT, "task": "poetry"})
        assert refused.status_code == 400 and "names no task 'poetry'" in refused.json()["error"]["message"]
    finally:
        server.stop()


# bart-large-cnn's generation_config.json, with lengths cut to fit a test, and a token banned as Marian's bans <pad>
GENERATION = {"num_beams": 4, "length_penalty": 2.0, "early_stopping": True, "no_repeat_ngram_size": 3,
              "min_length": 12, "max_length": 25}


@pytest.fixture(scope="module")
def configured(unit_scale_checkpoint, tmp_path_factory):
    """The checkpoint's conversion with a generation_config.json of its own, and the token it bans."""
    checkpoint = unit_scale_checkpoint
    if checkpoint.hf_model.config.num_decoder_layers > checkpoint.hf_model.config.num_layers:
        pytest.skip("transformers' generate() breaks when the decoder is deeper than the encoder")
    folder = tmp_path_factory.mktemp("configured") / "mlx"
    shutil.copytree(checkpoint.mlx_dir, folder)
    ids = checkpoint.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        plain = checkpoint.hf_model.generate(ids, do_sample=False, **GENERATION)[0, 1:].tolist()
    banned = max(set(plain), key=plain.count)
    generation = GENERATION | {"bad_words_ids": [[banned]]}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return checkpoint, folder, generation


def transformers_generation(checkpoint, generation: dict, **overrides) -> list[int]:
    ids = checkpoint.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = checkpoint.hf_model.generate(ids, do_sample=False, **(generation | overrides))
    return [token for token in out[0, 1:].tolist() if token not in (0, 1)]  # no padding, no EOS


def test_the_models_generation_defaults_apply_where_the_caller_gives_none_as_transformers_applies_them(configured, capsys):
    """With no options, the API decodes as transformers' generate() does
    with the same generation_config.json (beams, length penalty, early
    stopping, no-repeat n-grams, lengths, bad words); an option given
    overrides its default and keeps the others. With a draft loaded, the
    command line drafts and says in one line that the config's beams gave
    way; --num-beams searches."""
    checkpoint, folder, generation = configured
    models = load(folder)
    searched = transformers_generation(checkpoint, generation)
    assert searched != transformers_generation(checkpoint, {}, max_new_tokens=24), "the defaults must change the output"
    assert batch_generate(models, [PROMPT])[0].tokens == searched
    greedy = transformers_generation(checkpoint, generation, num_beams=1)
    assert batch_generate(models, [PROMPT], num_beams=1)[0].tokens == greedy != searched
    assert main.main(["--model", str(folder), "--regular-decode", "--json", "--prompt", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == searched
    assert main.main(["--model", str(folder), "--draft-model", str(folder), "--json", "--prompt", PROMPT]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == greedy
    assert "note: the model's generation config searches with 4 beams; drafting with the loaded draft model runs " \
           "instead (--num-beams 4 searches, with the target alone)\n" in err
    assert main.main(["--model", str(folder), "--draft-model", str(folder), "--json", "--prompt", PROMPT,
                      "--num-beams", "4"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == searched and "note:" not in err
