"""CTranslate2's Whisper folders (faster-whisper's models: model.bin, config.json, tokenizer.json, vocabulary.*) read as
the Hugging Face checkpoint they were converted from, so that convert.py takes them as it takes that checkpoint.

`ModelBin` reads CTranslate2's binary format a variable at a time (its layout: docs/DECISIONS.md); `WhisperReader`
names its variables as transformers' WhisperForConditionalGeneration does, splitting the fused query/key/value and
key/value projections by rows and reading only a part's rows; `configs` writes back config.json,
generation_config.json and preprocessor_config.json from the shapes, CTranslate2's config.json and the tokenizer.
"""

import json
import math
import re
import struct
from pathlib import Path

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx
import numpy as np

from errors import ConversionError

# CTranslate2's DataType enum, in its order (include/ctranslate2/types.h); bfloat16 read as its bits.
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, np.uint16)
BFLOAT16 = 5
VERSIONS = range(5, 7)  # what CTranslate2 3.x and 4.x write: per-variable dtypes and byte counts
GELU = 3  # CTranslate2's Activation enum (specs/common_spec.py)


def is_ctranslate2_folder(folder: Path) -> bool:
    return (folder / "model.bin").is_file() and not (folder / "pytorch_model.bin").exists()


class ModelBin:
    """model.bin's variables: name -> (shape, dtype id, byte offset), read from the header of each in one pass over
    the file that skips their data; a variable's data is read when asked for (memory: one variable)."""

    def __init__(self, path: Path):
        self.path, self.variables, self.aliases = path, {}, {}
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                def number(kind: str):
                    data = f.read(struct.calcsize(kind))
                    if len(data) < struct.calcsize(kind):
                        raise ValueError("it ends inside its header")
                    return struct.unpack("<" + kind, data)[0]

                def string() -> str:
                    length = number("H")
                    data = f.read(length)
                    if len(data) < length or not data.endswith(b"\0"):
                        raise ValueError("a name runs past the end of the file")
                    return data[:-1].decode()

                self.version = number("I")
                if self.version not in VERSIONS:
                    raise ValueError(f"binary version {self.version}; this reads versions {VERSIONS[0]}-{VERSIONS[-1]}")
                self.spec, self.revision = string(), number("I")
                for _ in range(number("I")):
                    name, rank = string(), number("B")
                    shape = [number("I") for _ in range(rank)]
                    dtype, length = number("B"), number("I")
                    if dtype >= len(DTYPES) or length != np.dtype(DTYPES[dtype]).itemsize * math.prod(shape):
                        raise ValueError(f"{name}'s byte count does not match its shape and type")
                    if f.tell() + length > size:
                        raise ValueError(f"{name} runs past the end of the file")
                    self.variables[name] = (shape, dtype, f.tell())
                    f.seek(length, 1)
                for _ in range(number("I")):
                    alias = string()
                    self.aliases[alias] = string()
        except (ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} is truncated or not CTranslate2's model.bin ({e})")
        except OSError as e:
            raise ConversionError(f"cannot read {path}: {e.strerror or e}")

    def has(self, name: str) -> bool:
        return name in self.variables or name in self.aliases

    def shape(self, name: str) -> list[int]:
        return self.variables[self.aliases.get(name, name)][0]

    def scalar(self, name: str):
        return self.array(name).item()

    def array(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """A variable (its rows `rows` only: a part of a fused projection), int8 and int16 dequantized with their
        scales (`NAME_scale`: one per output row, or one for all), bfloat16 widened to float32."""
        name = self.aliases.get(name, name)  # CTranslate2 stores equal variables once (a random model's norms)
        shape, dtype, offset = self.variables[name]
        start, stop, _ = rows.indices(shape[0]) if shape else (0, 1, 1)
        row = math.prod(shape[1:])
        kind = np.dtype(DTYPES[dtype])
        with open(self.path, "rb") as f:
            f.seek(offset + start * row * kind.itemsize)
            data = np.fromfile(f, dtype=kind, count=(stop - start) * row).reshape([stop - start, *shape[1:]])
        if dtype == BFLOAT16:
            return (data.astype(np.uint32) << 16).view(np.float32)
        if self.has(name + "_scale"):
            scale = self.array(name + "_scale")
            scale = scale[rows] if scale.ndim else scale
            return data.astype(np.float32) / scale.reshape([-1] + [1] * (data.ndim - 1))
        return data


# Transformers' name -> (CTranslate2's variable, which third or half of its rows: a part of a fused projection).
LAYER_NAMES = {
    "self_attn.q_proj": ("self_attention/linear_0", 0, 3), "self_attn.k_proj": ("self_attention/linear_0", 1, 3),
    "self_attn.v_proj": ("self_attention/linear_0", 2, 3), "self_attn.out_proj": ("self_attention/linear_1", 0, 1),
    "encoder_attn.q_proj": ("attention/linear_0", 0, 1), "encoder_attn.k_proj": ("attention/linear_1", 0, 2),
    "encoder_attn.v_proj": ("attention/linear_1", 1, 2), "encoder_attn.out_proj": ("attention/linear_2", 0, 1),
    "fc1": ("ffn/linear_0", 0, 1), "fc2": ("ffn/linear_1", 0, 1),
}
NORMS = {"self_attn_layer_norm": "self_attention/layer_norm", "encoder_attn_layer_norm": "attention/layer_norm",
         "final_layer_norm": "ffn/layer_norm"}


class WhisperReader:
    """A CTranslate2 Whisper's model.bin as transformers' state dict: names(), shape(name), tensor(name)."""

    def __init__(self, model: ModelBin):
        if model.spec != "WhisperSpec":
            raise ConversionError(f"{model.path} is a CTranslate2 {model.spec}: convert.py takes CTranslate2's Whisper "
                                  "models (faster-whisper's) only; convert the original Hugging Face checkpoint instead")
        self.model, self.sources = model, {}  # transformers' name -> (variable, rows)
        for side in ("encoder", "decoder"):
            for i in layer_numbers(model, side):
                for ours, (theirs, part, parts) in LAYER_NAMES.items():
                    variable = f"{side}/layer_{i}/{theirs}"
                    if not model.has(f"{variable}/weight"):
                        continue
                    rows = model.shape(f"{variable}/weight")[0] // parts
                    for kind in ("weight", "bias"):
                        if ours.endswith("k_proj") and kind == "bias":
                            continue  # Whisper projects its keys without a bias (CTranslate2 stores zeros)
                        self.sources[f"model.{side}.layers.{i}.{ours}.{kind}"] = (
                            f"{variable}/{kind}", slice(part * rows, (part + 1) * rows))
                for ours, theirs in NORMS.items():
                    if model.has(f"{side}/layer_{i}/{theirs}/gamma"):
                        self.sources[f"model.{side}.layers.{i}.{ours}.weight"] = (f"{side}/layer_{i}/{theirs}/gamma", slice(None))
                        self.sources[f"model.{side}.layers.{i}.{ours}.bias"] = (f"{side}/layer_{i}/{theirs}/beta", slice(None))
            self.sources[f"model.{side}.layer_norm.weight"] = (f"{side}/layer_norm/gamma", slice(None))
            self.sources[f"model.{side}.layer_norm.bias"] = (f"{side}/layer_norm/beta", slice(None))
            self.sources[f"model.{side}.embed_positions.weight"] = (f"{side}/position_encodings/encodings", slice(None))
        for conv in ("conv1", "conv2"):
            for kind in ("weight", "bias"):
                self.sources[f"model.encoder.{conv}.{kind}"] = (f"encoder/{conv}/{kind}", slice(None))
        self.sources["model.decoder.embed_tokens.weight"] = ("decoder/embeddings/weight", slice(None))
        missing = sorted(variable for variable, _ in self.sources.values() if not model.has(variable))
        if missing:
            raise ConversionError(f"{model.path} has no {missing[0]}: not a Whisper laid out as CTranslate2 writes one")
        settings = {name: model.scalar(f"decoder/{name}") for name in ("activation", "scale_embeddings", "pre_norm")}
        if settings != {"activation": GELU, "scale_embeddings": 0, "pre_norm": 1}:
            raise ConversionError(f"{model.path}: a Whisper whose decoder is not Whisper's ({settings})")

    def names(self) -> list[str]:
        return list(self.sources)

    def shape(self, name: str) -> list[int]:
        variable, rows = self.sources[name]
        shape = self.model.shape(variable)
        return [len(range(*rows.indices(shape[0]))), *shape[1:]]

    def tensor(self, name: str) -> mx.array:
        variable, rows = self.sources[name]
        return mx.array(self.model.array(variable, rows))


def layer_numbers(model: ModelBin, side: str) -> list[int]:
    names = [*model.variables, *model.aliases]
    return sorted({int(m[1]) for name in names if (m := re.match(rf"{side}/layer_(\d+)/", name))})


# ---------------------------------------------------------------- the configs transformers' checkpoint carries


def special_ids(folder: Path) -> dict[str, int]:
    """The tokenizer's added tokens: content -> id."""
    try:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        return {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ConversionError(f"{folder} has no readable tokenizer.json ({e}): a Whisper needs its tokenizer")


def configs(folder: Path, model: ModelBin) -> tuple[dict, dict[str, dict]]:
    """config.json, and the files beside it (generation_config.json, preprocessor_config.json unless the folder has
    one, tokenizer.json with the timestamps' tokens where it lacks them), as transformers' Whisper checkpoint of
    these weights has them: the shapes give the sizes, CTranslate2's config.json the suppressions, languages and
    alignment heads, the tokenizer the ids of Whisper's special tokens."""
    try:
        ct2 = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{folder / 'config.json'} is damaged ({e})")
    ids = special_ids(folder)
    if "<|endoftext|>" not in ids or "<|startoftranscript|>" not in ids:
        raise ConversionError(f"{folder}'s tokenizer.json lacks Whisper's <|endoftext|> and <|startoftranscript|>")
    end, start = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    vocabulary, d_model = model.shape("decoder/embeddings/weight")
    layers = {side: len(layer_numbers(model, side)) for side in ("encoder", "decoder")}
    ffn, heads = model.shape("encoder/layer_0/ffn/linear_0/weight")[0], int(model.scalar("encoder/num_heads"))
    suppress, begin_suppress = ct2.get("suppress_ids", []), ct2.get("suppress_ids_begin", [220, end])
    config = {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "vocab_size": vocabulary,
        "num_mel_bins": model.shape("encoder/conv1/weight")[1], "d_model": d_model,
        "encoder_layers": layers["encoder"], "decoder_layers": layers["decoder"],
        "encoder_attention_heads": heads, "decoder_attention_heads": int(model.scalar("decoder/num_heads")),
        "encoder_ffn_dim": ffn, "decoder_ffn_dim": model.shape("decoder/layer_0/ffn/linear_0/weight")[0],
        "max_source_positions": model.shape("encoder/position_encodings/encodings")[0],
        "max_target_positions": model.shape("decoder/position_encodings/encodings")[0],
        "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
        "bos_token_id": end, "eos_token_id": end, "pad_token_id": end, "decoder_start_token_id": start,
        # As Hugging Face's Whisper configs carry them (else WhisperConfig's defaults, the English models' ids, stand)
        "suppress_tokens": suppress, "begin_suppress_tokens": begin_suppress,
    }
    # Every English-only Whisper (.en) has 51,864 tokens, the multilingual ones 51,865 or more (OpenAI's test is
    # >= 51,865); other sizes, a test's small models, are taken as multilingual, their languages in the tokenizer.
    multilingual = vocabulary != 51864
    by_id = {i: token for token, i in ids.items()}
    generation = {
        "bos_token_id": end, "eos_token_id": end, "pad_token_id": end, "decoder_start_token_id": start,
        "max_length": config["max_target_positions"], "is_multilingual": multilingual,
        "no_timestamps_token_id": ids.get("<|notimestamps|>"), "prev_sot_token_id": ids.get("<|startofprev|>"),
        "max_initial_timestamp_index": 50,  # OpenAI's decoding default: the first timestamp within 1 s
        "suppress_tokens": suppress, "begin_suppress_tokens": begin_suppress, "return_timestamps": False,
        "alignment_heads": ct2.get("alignment_heads") or [[layer, head] for layer in range(layers["decoder"] // 2,
                                                                                            layers["decoder"])
                                                           for head in range(heads)],
    }
    if multilingual:
        generation["lang_to_id"] = {by_id[i]: i for i in ct2.get("lang_ids", []) if i in by_id}
        generation["task_to_id"] = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    files = {"generation_config.json": generation, "tokenizer.json": with_timestamps(folder, vocabulary)}
    if not (folder / "preprocessor_config.json").is_file():
        files["preprocessor_config.json"] = {
            "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "WhisperProcessor",
            "feature_size": config["num_mel_bins"], "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
            "chunk_length": 30, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
            "padding_value": 0.0, "return_attention_mask": False}
    return config, files


def with_timestamps(folder: Path, vocabulary: int) -> dict:
    """The tokenizer, its vocabulary completed to the model's with the timestamp tokens (<|0.00|> to <|30.00|>) as
    transformers' newer Whisper tokenizers carry them: faster-whisper's tiny.en stops at <|notimestamps|>."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    last = max(token["id"] for token in tokenizer["added_tokens"])
    for i in range(last + 1, vocabulary):
        tokenizer["added_tokens"].append({"id": i, "content": f"<|{(i - last - 1) * 0.02:.2f}|>", "single_word": False,
                                          "lstrip": False, "rstrip": False, "normalized": True, "special": False})
    return tokenizer


def write_checkpoint(folder: Path, out: Path) -> None:
    """The Hugging Face checkpoint a CTranslate2 Whisper was converted from, in float32 (for the references that read
    transformers' layout: bench whisper's transformers and mlx-whisper). Holds the whole model in memory."""
    from safetensors.numpy import save_file

    model = ModelBin(folder / "model.bin")
    reader, (config, files) = WhisperReader(model), configs(folder, model)
    out.mkdir(parents=True)
    save_file({name: np.ascontiguousarray(model.array(*reader.sources[name]), np.float32) for name in reader.names()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, contents in {"config.json": config, **files}.items():
        (out / name).write_text(json.dumps(contents, indent=2, ensure_ascii=False))
    if (folder / "preprocessor_config.json").is_file():
        (out / "preprocessor_config.json").write_text((folder / "preprocessor_config.json").read_text())
