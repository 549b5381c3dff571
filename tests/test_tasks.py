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
