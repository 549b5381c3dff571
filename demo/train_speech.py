"""Train the demo's speech pair: a small English Whisper and a draft that keeps its encoder.

espeak-ng speaks sentences of the Python standard library's docstrings in many voices, speeds and pitches; windows
(10 s by default: a CPU's step costs about a third of a 30 s one's) are built from those clips as training goes (one
sentence, or several with pauses between them, the last one sometimes cut by the window's end as in long files),
with light noise, and labelled as Whisper is: the start of transcript, then either no-timestamps and the text, or
each sentence between its start and end timestamps. A sentence is held out when the first byte of its SHA-1 is below
26 (about 10%). The target and the draft are transformers' own Whisper classes; the draft's one decoder layer reads
the target's encoder output (its gradient does not reach the encoder), learning the text and the target's
distribution together, and is saved with the target's encoder, as distil-whisper is. A quarter of the decoder's
input text tokens are swapped for random ones (--corrupt), so that it cannot finish a sentence it has learnt from
its first words without listening. The encoder also feeds a CTC head that spells the letters it hears (not saved).

    python demo/train_speech.py                  # 100 minutes on 2 CPU cores: the shipped pair (docs/DEMO.md)
    python demo/train_speech.py --resume demo/speech/hf --out /tmp/more/hf   # on from a pair it wrote
    python demo/train_speech.py --quick --out /tmp/speech/hf   # a few steps, to try it
    python demo/train_speech.py --ship           # only convert demo/speech/hf and write the clips

Writes, under --out (default demo/speech/hf): target/ and draft/ as Hugging Face checkpoints (tokenizer.json,
preprocessor_config.json, generation_config.json beside the weights) and training.json (seeds, corpus, shapes,
steps, the learning curve with the held-out figures every --check-every steps, the final held-out figures, and the
record of the run it went on from); and beside --out (demo/speech), what ships: target/ and draft/ converted for
MLX, training.json, and clips/, a few held-out sentences spoken as WAV files with clips.json. The corpus is the
standard library of the Python that runs this; training.json records its version and the sentence counts.
"""

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
import wave
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

DEMO_SPEECH = Path(__file__).resolve().parent / "speech"  # what ships: the pair, its record, its clips
RATE = 16_000
WINDOW = 30 * RATE
STEP = 0.02  # seconds per timestamp token
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
            "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"] + [f"<|{i * STEP:.2f}|>" for i in range(1501)]
VOICES = ["en", "en-us", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd"]
VARIANTS = ["", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4", "+f5"]
LETTERS = " abcdefghijklmnopqrstuvwxyz',."  # what the CTC head spells (its blank is 0)
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


def make_tokenizer(sentences: list[str]) -> Tokenizer:
    """Byte-level BPE as Whisper's, 1,024 pieces learned on the training sentences, then Whisper's special tokens in
    its order (the end of text first, the timestamps last)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([" " + s for s in sentences], trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    return tokenizer


class Windows:
    """Random 30 s windows of the clips and their labels, as Whisper is trained on them."""

    def __init__(self, samples, clips, sentences, tokenizer, device, seed, seconds: int = 30):
        self.samples, self.clips, self.device, self.size = samples.to(device), clips, device, seconds * RATE
        self.rng = random.Random(seed)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.text = [tokenizer.encode(" " + s).ids for s in sentences]
        self.start, self.none = tokenizer.token_to_id("<|startoftranscript|>"), tokenizer.token_to_id("<|notimestamps|>")
        # Each text token's letters, for the CTC head (lower case; the texts are ASCII, a token is whole characters).
        self.letters = {i: [LETTERS.index(c) + 1 for c in tokenizer.decode([i]).lower() if c in LETTERS]
                        for i in range(tokenizer.token_to_id("<|endoftext|>"))}
        self.end, self.first_time = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|0.00|>")
        self.mel = torch.from_numpy(WhisperFeatureExtractor(feature_size=80).mel_filters).float().to(device)
        self.hann = torch.hann_window(400, device=device)

    def time(self, seconds: float) -> int:
        return self.first_time + min(round(self.size / RATE / STEP), round(seconds / STEP))

    def window(self, audio: torch.Tensor) -> list[int]:
        """Fills audio (a window's samples) with clips; returns the labelled tokens."""
        rng, timestamps = self.rng, self.rng.random() < 0.6
        at, tokens = rng.uniform(0, 1.0) * RATE, [self.start] + ([] if timestamps else [self.none])
        count = 1 if rng.random() < 0.4 else 99
        while count:
            sentence, offset, length = self.clips[rng.randrange(len(self.clips))]
            begin = int(at)
            if begin + length > self.size:
                # A sentence the window cuts, in a long file: its start timestamp ends the window's labels (the
                # next window starts there); without timestamps the window holds only whole sentences.
                if timestamps and tokens[-1] != self.start and begin < self.size - RATE and rng.random() < 0.5:
                    audio[begin:] += self.samples[offset:offset + self.size - begin]
                    tokens.append(self.time(begin / RATE))
                break
            audio[begin:begin + length] += self.samples[offset:offset + length]
            if timestamps:
                tokens += [self.time(begin / RATE), *self.text[sentence], self.time((begin + length) / RATE)]
            else:
                tokens += self.text[sentence]
            at, count = begin + length + rng.uniform(0.15, 2.0) * RATE, count - 1
        return tokens + [self.end]

    def spelled(self, labels: list[list[int]]) -> list[list[int]]:
        """The letters of each window's text tokens (specials and timestamps left out)."""
        return [[letter for token in tokens if token in self.letters for letter in self.letters[token]]
                for tokens in labels]

    def batch(self, size: int):
        audio = torch.zeros(size, self.size, device=self.device)
        labels = [self.window(audio[i]) for i in range(size)]
        gain = torch.empty(size, 1, device=self.device).uniform_(0.2, 1.0, generator=self.generator)
        noise = 10 ** torch.empty(size, 1, device=self.device).uniform_(-4.0, -2.3, generator=self.generator)
        audio = audio * gain + noise * torch.randn(audio.shape, device=self.device, generator=self.generator)
        return self.features(audio), labels

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        """Log-mel features as transformers' WhisperFeatureExtractor computes them (its torch path)."""
        stft = torch.stft(audio, 400, 160, window=self.hann, return_complex=True)
        power = stft[..., :-1].abs() ** 2
        logs = torch.clamp(self.mel.T @ power, min=1e-10).log10()
        logs = torch.maximum(logs, logs.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (logs + 4.0) / 4.0


def padded(labels: list[list[int]], end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs (each sequence but its last token, padded with the end of text) and the targets (each but its
    first, padded with -100, which the loss skips)."""
    width = max(map(len, labels)) - 1
    inputs = torch.full((len(labels), width), end, dtype=torch.long)
    targets = torch.full((len(labels), width), -100, dtype=torch.long)
    for row, tokens in enumerate(labels):
        inputs[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
        targets[row, :len(tokens) - 1] = torch.tensor(tokens[1:])
    return inputs.to(device), targets.to(device)


def noisy(inputs: torch.Tensor, rate: float, end: int) -> torch.Tensor:
    """The decoder's inputs with a `rate` of their text tokens (below the end of text; not the first, the start of
    transcript) swapped for random ones. A decoder that reads its own history can finish a sentence it has learnt
    from its first words without listening; one whose history is unreliable must listen to know what comes next."""
    swap = (torch.rand(inputs.shape, device=inputs.device) < rate) & (inputs < end)
    swap[:, 0] = False
    return torch.where(swap, torch.randint_like(inputs, end), inputs)


def configs(tokenizer: Tokenizer, seconds: int = 30) -> tuple[WhisperConfig, WhisperConfig]:
    """The target's and the draft's shapes; `seconds`, the window the encoder reads (every public Whisper's: 30 s)."""
    end, start = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|startoftranscript|>")
    # Small enough that a 2-core CPU takes a step of 16 windows of 10 s in about 2 s: the encoder, a window's 500
    # positions in every layer, is most of a step's cost, so it has 3 layers to the target decoder's 6.
    shape = dict(vocab_size=tokenizer.get_vocab_size(), num_mel_bins=80, d_model=192, encoder_layers=3,
                 encoder_attention_heads=3, encoder_ffn_dim=768, decoder_attention_heads=3, decoder_ffn_dim=768,
                 max_source_positions=seconds * 50, max_target_positions=448, pad_token_id=end, bos_token_id=end,
                 eos_token_id=end, decoder_start_token_id=start, begin_suppress_tokens=None, suppress_tokens=None,
                 dropout=0.0)
    return WhisperConfig(decoder_layers=6, **shape), WhisperConfig(decoder_layers=1, **shape)


def generation_config(tokenizer: Tokenizer) -> GenerationConfig:
    """An English-only model's rules (as whisper-tiny.en's): the start, no-timestamps, the end and a space are
    suppressed at the start."""
    ids = tokenizer.token_to_id
    return GenerationConfig(
        decoder_start_token_id=ids("<|startoftranscript|>"), eos_token_id=ids("<|endoftext|>"),
        pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"), is_multilingual=False,
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        suppress_tokens=[ids("<|translate|>"), ids("<|transcribe|>"), ids("<|startoflm|>"), ids("<|startofprev|>"),
                         ids("<|nospeech|>"), ids("<|en|>")],
        begin_suppress_tokens=[ids("Ġ"), ids("<|endoftext|>")], max_initial_timestamp_index=50, max_length=448)


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


@torch.no_grad()
def evaluate(target, draft, windows: Windows, sentences: list[str], clips, tokenizer, device, heard=None) -> dict:
    """The target's greedy text of held-out sentences alone in a window (no timestamps) against the sentences; how
    often the draft's argmax is the target's, fed the target's greedy tokens; and, given the CTC head, the error
    rate of the letters it hears (whether the encoder has begun to listen, whatever the decoder does)."""
    target.eval(), draft.eval()
    references, hypotheses, spelled, agreed, compared = [], [], [], 0, 0
    for first in range(0, len(clips), 50):
        chunk = clips[first:first + 50]
        audio = torch.zeros(len(chunk), windows.size, device=device)
        for row, (sentence, offset, length) in enumerate(chunk):
            audio[row, RATE // 2:RATE // 2 + length] = windows.samples[offset:offset + length]
        features = windows.features(audio)
        opening = torch.tensor([[windows.start, windows.none]] * len(chunk), device=device)
        encoded = target.model.encoder(features).last_hidden_state
        if heard is not None:
            for best in heard(encoded).argmax(-1).tolist():  # CTC's greedy reading: repeats merged, blanks dropped
                spelled.append("".join(LETTERS[b - 1] for i, b in enumerate(best) if b and (i == 0 or b != best[i - 1])))
        ids = opening
        for _ in range(120):  # greedy, a forward pass per token: plain and exact
            logits = target(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            if (ids == windows.end).any(1).all():
                break
        drafted = draft.proj_out(draft.model.decoder(input_ids=ids, encoder_hidden_states=encoded).last_hidden_state)
        truth = target(encoder_outputs=(encoded,), decoder_input_ids=ids).logits
        for row, (sentence, _, _) in enumerate(chunk):
            tokens = ids[row, 2:].tolist()
            length = tokens.index(windows.end) if windows.end in tokens else len(tokens)
            hypotheses.append(tokenizer.decode(tokens[:length]))
            references.append(sentences[sentence])
            span = slice(1, 2 + length)  # predictions of the text tokens and the end of text
            agreed += int((drafted[row, span].argmax(-1) == truth[row, span].argmax(-1)).sum())
            compared += 2 + length - 1
    target.train(), draft.train()
    examples = [{"sentence": r, "heard": h} for r, h in list(zip(references, hypotheses))[:5]]
    return {"word_error_rate": word_error_rate(references, hypotheses), "draft_agreement": agreed / compared,
            "clips": len(clips), "examples": examples} | (
        {"ctc_word_error_rate": word_error_rate(references, spelled)} if heard is not None else {})


def step_losses(target, draft, heard, features, labels: list[list[int]], letters: list[list[int]], end: int, device,
                autocast: bool | None = None, corrupt: float = 0.0) -> dict:
    """A batch's losses: the target's and the draft's next tokens, the draft against the target's distribution, and
    the encoder's CTC over letters (a head that is not saved: a decoder that can guess the next word from the last
    ones learns that long before it learns to listen, and this loss makes the encoder say what it hears from the
    first steps; letters, few and each a sound or two long, leave CTC's all-blank plateau far sooner than 1,024 BPE
    pieces). `corrupt`: the rate of the decoder's input tokens made noisy (the targets stay the true tokens)."""
    inputs, targets = padded(labels, end, device)
    inputs = noisy(inputs, corrupt, end) if corrupt else inputs
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" if autocast is None else autocast):
        encoded = target.model.encoder(features).last_hidden_state
        logits = target(encoder_outputs=(encoded,), decoder_input_ids=inputs).logits.float()
        drafted = draft.proj_out(draft.model.decoder(input_ids=inputs, encoder_hidden_states=encoded.detach())
                                 .last_hidden_state).float()
        frames = heard(encoded).float()
    mask = targets != -100
    # The draft also learns the target's distribution, so that it proposes what the target would accept.
    distilled = (F.kl_div(drafted.log_softmax(-1), logits.detach().log_softmax(-1), log_target=True,
                          reduction="none").sum(-1) * mask).sum() / mask.sum()
    ctc = F.ctc_loss(frames.log_softmax(-1).transpose(0, 1), torch.tensor(sum(letters, []), device=device),
                     torch.full((len(letters),), encoded.shape[1]), torch.tensor([len(t) for t in letters]),
                     blank=0, zero_infinity=True)
    return {"target": F.cross_entropy(logits.transpose(1, 2), targets),
            "draft": F.cross_entropy(drafted.transpose(1, 2), targets), "distilled": distilled, "ctc": ctc}


def train(target, draft, heard, windows: Windows, batch: int, steps: int | None, minutes: float, device,
          every: int = 200, peak: float = 1e-3, warmup: int = 300, corrupt: float = 0.0, check=None,
          check_every: int = 1000) -> tuple[list[dict], int]:
    """Trains for `steps` steps or `minutes`: the learning rate warms up to `peak` over `warmup` steps, then falls
    by a cosine; returns the mean losses of each `every` steps, with check()'s held-out figures each `check_every`
    steps, and the steps taken."""
    parameters = list(target.parameters()) + list(draft.parameters()) + list(heard.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=peak, betas=(0.9, 0.98), weight_decay=0.01)
    history, losses, step, began = [], [], 0, time.time()
    while (step < steps) if steps else (time.time() - began < minutes * 60):
        done = step / steps if steps else (time.time() - began) / (minutes * 60)
        for group in optimizer.param_groups:
            group["lr"] = peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))
        features, labels = windows.batch(batch)
        parts = step_losses(target, draft, heard, features, labels, windows.spelled(labels), windows.end, device,
                            corrupt=corrupt)
        loss = parts["target"] + 0.5 * parts["draft"] + 0.5 * parts["distilled"] + 0.3 * parts["ctc"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append({name: value.item() for name, value in parts.items()})
        step += 1
        if step % every == 0:
            history.append({"step": step, "seconds": round(time.time() - began, 1)}
                           | {name: round(float(np.mean([x[name] for x in losses])), 4) for name in losses[0]})
            if check is not None and step % check_every == 0:
                figures = check()
                history[-1] |= {name: round(figures[name], 3) for name in
                                ("word_error_rate", "draft_agreement", "ctc_word_error_rate") if name in figures}
            print(history[-1], flush=True)
            losses = []
    return history, step


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


def ship(hf: Path, out: Path, voices: list[str]) -> None:
    """demo/speech: the pair converted for MLX (float32, as the T5 pair), its training's record, its held-out clips."""
    for name in ("target", "draft"):
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "convert.py"), "--model",
                        str(hf / name), "--out", str(out / name), "--dtype", "float32", "--force"], check=True)
    (out / "training.json").write_text((hf / "training.json").read_text())
    write_clips(out / "clips", corpus_sentences(), voices)


def training_sentences(train: list[str], shuffled: int, seed: int) -> list[str]:
    """The training sentences, and as many again of their words in random order: sentences alone are few enough
    to learn by heart, and a decoder that has can write one from its first words without listening."""
    words, rng = [w for s in train for w in s[:-1].replace(",", "").split()], random.Random(seed)
    made = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) + "." for _ in range(shuffled)]
    return train + [s[0].upper() + s[1:] for s in made]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_SPEECH / "hf", help="the pair; its parent: all that ships")
    parser.add_argument("--ship", action="store_true", help="only convert the pair in --out and write the clips")
    parser.add_argument("--minutes", type=float, default=100.0, help="training time; the step count follows from it")
    parser.add_argument("--steps", type=int, help="a fixed number of steps instead of --minutes")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--voicings", type=int, default=2, help="voices each training sentence is spoken in")
    parser.add_argument("--shuffled", type=int, default=6000, help="sentences of training words in random order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few sentences and steps, to try it")
    parser.add_argument("--resume", type=Path, help="a pair this wrote, to train on (its tokenizer kept)")
    parser.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    parser.add_argument("--warmup", type=int, default=300, help="steps to warm the learning rate up over")
    parser.add_argument("--window", type=int, default=10, help="seconds the encoder reads at once")
    parser.add_argument("--voices", default="en-us,en", help="espeak-ng's accents to speak in, by commas")
    parser.add_argument("--check-every", type=int, default=1000, help="steps between held-out figures (of 200s)")
    parser.add_argument("--corrupt", type=float, default=0.25, help="the rate of the decoder's input tokens made noisy")
    args = parser.parse_args()
    if args.check_every % 200:  # (the figures join the curve's line of 200 steps that ends there)
        parser.error("--check-every must be a multiple of 200")
    if args.quick and args.out == parser.get_default("out"):
        parser.error("--quick trains a pair that is no demo: give --out, so that demo/speech stays as it is")
    args.window = WhisperConfig.from_pretrained(args.resume / "target").max_source_positions // 50 if args.resume else args.window
    return args


def main():
    args = parse_args()
    if args.ship:
        ship(args.out, args.out.parent, json.loads((args.out / "training.json").read_text())["voices"])
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    began = time.time()

    sentences = corpus_sentences()
    train_set = [s for s in sentences if not held_out(s)]
    test = [s for s in sentences if held_out(s)]
    if args.quick:
        train_set, test, args.steps, args.batch, args.voicings, args.shuffled = train_set[:60], test[:10], 4, 4, 1, 20
    tokenizer = Tokenizer.from_file(str(args.resume / "target" / "tokenizer.json")) if args.resume \
        else make_tokenizer(train_set)
    train_set = training_sentences(train_set, args.shuffled, args.seed)
    voices = args.voices.split(",")
    samples, clips = synthesize(train_set, args.voicings, args.seed, voices)
    test_samples, test_clips = synthesize(test, 1, args.seed + 1, voices)
    longest = (args.window - 0.5) * RATE  # a clip a window cannot hold whole is left out
    clips, test_clips = [c for c in clips if c[2] <= longest], [c for c in test_clips if c[2] <= longest]
    spoken_seconds = len(samples) / RATE
    print(f"{len(train_set)} training sentences ({spoken_seconds / 3600:.1f} h spoken), {len(test)} held out; "
          f"{time.time() - began:.0f} s to speak them", flush=True)

    target_config, draft_config = configs(tokenizer, args.window)
    if args.resume:  # the draft's saved encoder is the target's, or absent
        target = WhisperForConditionalGeneration.from_pretrained(args.resume / "target").to(device).train()
        draft = WhisperForConditionalGeneration.from_pretrained(args.resume / "draft").to(device).train()
        before = json.loads((args.resume / "training.json").read_text())
    else:
        target = WhisperForConditionalGeneration(target_config).to(device).train()
        draft = WhisperForConditionalGeneration(draft_config).to(device).train()
        before = None
    draft.model.encoder = None  # trained on the target's encoder output; saved with the target's encoder
    heard = torch.nn.Linear(target_config.d_model, len(LETTERS) + 1).to(device)  # the CTC head
    windows = Windows(samples, clips, train_set, tokenizer, device, args.seed, args.window)
    test_windows = Windows(test_samples, test_clips, test, tokenizer, device, args.seed + 1, args.window)
    step_began = time.time()
    history, steps = train(target, draft, heard, windows, args.batch, args.steps, args.minutes, device,
                           every=2 if args.quick else 200, peak=args.lr, warmup=args.warmup, corrupt=args.corrupt,
                           check=lambda: evaluate(target, draft, test_windows, test, test_clips[:100], tokenizer, device, heard),
                           check_every=4 if args.quick else args.check_every)
    trained = time.time() - step_began

    draft.model.encoder = target.model.encoder
    figures = evaluate(target, draft, test_windows, test, test_clips[:250], tokenizer, device)
    print(figures, flush=True)
    for name, model in (("target", target), ("draft", draft)):
        folder = args.out / name
        model.generation_config = generation_config(tokenizer)
        model.to(torch.float32).save_pretrained(folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        WhisperFeatureExtractor(feature_size=80, chunk_length=args.window).save_pretrained(folder)
    record = {
        "seed": args.seed, "python": sysconfig.get_python_version(), "torch": torch.__version__, "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "sentences": {"training": len(train_set), "held_out": len(test), "voicings": args.voicings,
                      "spoken_hours": round(spoken_seconds / 3600, 2)},
        "batch": args.batch, "steps": steps, "training_seconds": round(trained, 1),
        "parameters": {"target": sum(p.numel() for p in target.parameters()),
                       "draft": sum(p.numel() for p in draft.parameters())},
        "history": history, "held_out": figures, "lr": args.lr, "warmup": args.warmup,
        "corrupt": args.corrupt, "window_seconds": args.window, "voices": voices,
        "resumed": before,  # the run this one went on from (its own record, and so on back)
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    ship(args.out, args.out.parent, voices)
    print(f"written to {args.out} and {args.out.parent} in {time.time() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
