"""The references, each in a process of its own: Hugging Face transformers (PyTorch CPU) and CTranslate2.

`HFWorker` and `CT2Worker` start `python -m bench --hf-worker ...` or
`--ct2-worker ...`, whose loops (`hf_worker`, `ct2_worker`) answer one greedy
generation per JSON line, on as many threads as the machine has cores.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import Worker


def hf_worker(checkpoint: str, assistant: str | None, num_draft: int, cache_fix: bool) -> None:
    """Persistent transformers process: one greedy generation per input line
    (JSON: prompt ids, max and min new tokens, beams if not 1), assisted by `assistant` with a
    constant number of draft tokens if given. It counts the candidates the
    assistant proposed and the target accepted, round by round.

    cache_fix: transformers 5 drafts from a corrupted cache when the assistant
    is an encoder-decoder model. `_prefill` cuts the already-cached tokens off
    the assistant's decoder input only when an attention mask as long as that
    input is given, and none is: each round feeds the whole sequence again on
    top of the cache. Passing the mask restores drafting from the right
    context (docs/PERFORMANCE.md has the evidence)."""
    import torch
    import transformers
    from transformers import AutoModelForSeq2SeqLM
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval()  # T5, or another family's checkpoint
    options, counts = {}, {"proposed": 0, "accepted": 0}
    if assistant:
        draft = AutoModelForSeq2SeqLM.from_pretrained(assistant).eval()
        draft.generation_config.num_assistant_tokens = num_draft
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        options["assistant_model"] = draft
        update, get_candidates = AssistedCandidateGenerator.update_candidate_strategy, AssistedCandidateGenerator.get_candidates

        def counting(self, input_ids, scores, num_matches):
            counts["proposed"] += scores.shape[1] - 1  # the candidates; the last score is the target's own token
            counts["accepted"] += int(num_matches)
            return update(self, input_ids, scores, num_matches)

        def with_decoder_mask(self, input_ids, **kwargs):
            self.assistant_kwargs["decoder_attention_mask"] = torch.ones_like(input_ids)
            return get_candidates(self, input_ids, **kwargs)

        AssistedCandidateGenerator.update_candidate_strategy = counting
        if cache_fix:
            AssistedCandidateGenerator.get_candidates = with_decoder_mask
    print(json.dumps({"ready": f"transformers {transformers.__version__}, PyTorch {torch.__version__}"}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        counts.update(proposed=0, accepted=0)
        if "prompts" in request:  # a batched greedy generation, batch_size prompts at a time
            print(json.dumps(hf_batched(model, request["prompts"], request["tokens"], request["batch_size"])), flush=True)
            continue
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(torch.tensor([request["prompt"]]), max_new_tokens=request["tokens"],
                                 min_new_tokens=request["min_tokens"], do_sample=False,
                                 num_beams=request.get("beams", 1), **options)
            seconds = time.perf_counter() - start
        tokens = [t for t in out[0, 1:].tolist() if t != model.config.eos_token_id]
        print(json.dumps({"seconds": seconds, "tokens": tokens, **counts}), flush=True)


def hf_batched(model, prompts: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    """transformers' batched greedy generate over the prompts, padded on the
    right with an attention mask, as its T5 documentation does it."""
    import torch

    start, tokens = time.perf_counter(), []
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            group = prompts[first : first + batch_size]
            width = max(len(p) for p in group)
            ids = torch.tensor([p + [pad] * (width - len(p)) for p in group])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, num_beams=1)
            for row in out[:, 1:].tolist():
                tokens.append(row[: row.index(eos)] if eos in row else row)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


class HFWorker(Worker):
    """transformers on a Hugging Face checkpoint: regular greedy generation,
    batched generation, or assisted by `assistant` (cache_fix: see hf_worker)."""

    def __init__(self, checkpoint: Path, assistant: Path | None = None, num_draft: int = 0, cache_fix: bool = False):
        flags = ["--hf-worker", str(checkpoint), "--num-draft", str(num_draft)]
        if assistant:
            flags += ["--assistant", str(assistant)] + ["--cache-fix"] * cache_fix
        super().__init__(*flags)

    def run_batched(self, prompts: list[list[int]], tokens: int, batch_size: int) -> dict:
        return self.ask({"prompts": prompts, "tokens": tokens, "batch_size": batch_size})


def ct2_worker(folder: str) -> None:
    """Persistent CTranslate2 process: one greedy generation per input line,
    as HFWorker's, on every core (intra_threads), one batch at a time."""
    import ctranslate2

    vocabulary = json.loads((Path(folder) / "shared_vocabulary.json").read_text())
    index = {token: i for i, token in enumerate(vocabulary)}
    translator = ctranslate2.Translator(folder, device="cpu", intra_threads=os.cpu_count() or 1, inter_threads=1)
    print(json.dumps({"ready": ctranslate2.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        result = translator.translate_batch([[vocabulary[i] for i in request["prompt"]]], beam_size=request.get("beams", 1),
                                            max_decoding_length=request["tokens"],
                                            min_decoding_length=request["min_tokens"])
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "tokens": [index[token] for token in result[0].hypotheses[0]]}), flush=True)


def unique_vocabulary(path: Path) -> None:
    """CTranslate2's converter pads the tokenizer's vocabulary up to the
    model's by appending <extra_id_N> names that repeat the tokenizer's own
    sentinels, so a name would stand for two ids. Renaming the padding makes
    names and ids one to one (the padded ids are never a prompt's)."""
    vocabulary, seen = json.loads(path.read_text()), set()
    for i, token in enumerate(vocabulary):
        if token in seen:
            vocabulary[i] = f"<ct2_padding_{i}>"
        seen.add(vocabulary[i])
    path.write_text(json.dumps(vocabulary))


def intel_openmp() -> str | None:
    """Intel's OpenMP runtime (intel-openmp, which MKL brings from PyPI)."""
    try:
        files = importlib.metadata.files("intel-openmp") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(file.locate()) for file in files if file.name.startswith("libiomp5.so")), None)


class CT2Worker(Worker):
    """CTranslate2 (the fastest T5 on a CPU) on a Hugging Face checkpoint,
    converted once by its own converter, in float32 or int8. Its PyPI wheel
    runs its threads on GNU OpenMP, whose idle threads sleep between
    parallel regions; `intel_openmp` preloads Intel's runtime in their place,
    whose threads spin, as MKL's do for us (docs/PERFORMANCE.md: on a
    virtual machine's cores, waking a sleeping thread is slow)."""

    def __init__(self, checkpoint: Path, quantization: str, root: Path, intel_openmp_runtime: bool = False):
        folder = root / f"{checkpoint.name}-ct2-{quantization}"
        if not (folder / "model.bin").exists():
            print(f"converting {checkpoint} for CTranslate2 ({quantization}) ...", file=sys.stderr)
            script = ("import sys, ctranslate2; ctranslate2.converters.TransformersConverter(sys.argv[1])"
                      ".convert(sys.argv[2], quantization=sys.argv[3], force=True)")
            done = subprocess.run([sys.executable, "-c", script, str(checkpoint), str(folder), quantization],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"CTranslate2's conversion failed: {done.stderr.strip()}")
        unique_vocabulary(folder / "shared_vocabulary.json")
        preload = intel_openmp() if intel_openmp_runtime else None
        if intel_openmp_runtime and preload is None:
            raise RuntimeError("intel-openmp is not installed (pip install intel-openmp)")
        super().__init__("--ct2-worker", str(folder), env={"LD_PRELOAD": preload} if preload else None)


def ct2_installed() -> bool:
    try:
        importlib.metadata.version("ctranslate2")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# CTranslate2's configurations: (quantization, with Intel's OpenMP runtime)
CT2_KINDS = {"CTranslate2 fp32": ("float32", False), "CTranslate2 int8": ("int8", False),
             "CTranslate2 fp32, Intel OpenMP": ("float32", True), "CTranslate2 int8, Intel OpenMP": ("int8", True)}


def ct2_workers(checkpoint: Path, root: Path) -> dict[str, CT2Worker]:
    """Every CTranslate2 configuration on the checkpoint; none (said on
    stderr) when CTranslate2 is not installed."""
    if not ct2_installed():
        print("CTranslate2 is not installed (pip install ctranslate2): its rows are left out", file=sys.stderr)
        return {}
    return {name: CT2Worker(checkpoint, quantization, root, iomp) for name, (quantization, iomp) in CT2_KINDS.items()
            if not iomp or intel_openmp()}
