"""Convert a Hugging Face checkpoint (hub id or local folder) of any family here to MLX weights: T5 and its
descendants, BART, mBART, Marian, M2M-100, NLLB, Pegasus, and Whisper; and CTranslate2's Whisper folders (faster-whisper's).

    python convert.py --model t5-small
    python convert.py --model google/flan-t5-large --dtype float16 --out my_models/flan
    python convert.py --model t5-11b -q                      # 4-bit, groups of 64
    python convert.py --model mlx_models/t5-11b -q --q-bits 8  # from an earlier conversion
    python convert.py --model ~/.cache/huggingface/hub/models--Systran--faster-whisper-base/snapshots/REV

Memory stays bounded by about one tensor: each tensor is read, cast (or
quantized) and appended to a safetensors shard whose header was written up
front from the shapes alone. The output folder appears only when complete.

Quantized models follow mlx-lm's layout: MLX's affine quantization, each
quantized weight stored as `.weight` (packed uint32), `.scales` and `.biases`,
and `"quantization": {"group_size", "bits", "mode"}` in config.json. A layer
without `.scales` stays in float.
"""

import argparse
import json
import math
import re
import shutil
import signal
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import cpu  # before mlx.core
import mlx.core as mx
from mlx.utils import tree_flatten
from tqdm import tqdm

import families
import from_ctranslate2
from errors import ConversionError, LoadError
from loading import FORMAT_KEY, could_be_hub_id, read_config
from model import EncoderDecoder, ModelArgs
from weights import SafetensorsReader, TorchReader, atomic_folder, weight_files

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
SAFETENSORS_DTYPE = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


def default_dtype() -> str:
    """bfloat16 on the accelerator path (a Mac's GPU): T5 was trained in it on
    TPUs, so it keeps float32's range (v1.0 models overflow float16 without
    clamping) at half the memory and bandwidth. MLX's CPU backend has no fast
    half-precision products (bfloat16 decodes several times slower than
    float32 there: python -m bench quantized), so float32 on the CPU path."""
    return "float32" if cpu.in_use() else "bfloat16"


SHARD_BYTES = 4 << 30

TOKENIZER_FILES = ["spiece.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "sentencepiece.bpe.model",  # BART's, mBART's and NLLB's
                   "source.spm", "target.spm"]  # Marian's
CONFIG_FILES = ["config.json", "generation_config.json", "preprocessor_config.json"]  # (Whisper's feature extractor)
SAFETENSORS_PATTERNS = ["model.safetensors", "model-*.safetensors", "model.safetensors.index.json"]
TORCH_PATTERNS = ["pytorch_model.bin", "pytorch_model-*.bin", "pytorch_model.bin.index.json"]

# Quantized: every projection, the embedding and a separate head. The
# relative-position bias tables and the norms stay in float.
QUANTIZED = re.compile(r"(\.(q|k|v|o|wi|wi_0|wi_1|wo)|^shared|^lm_head)\.weight$")
Q_BITS, Q_GROUP_SIZES = (2, 3, 4, 5, 6, 8), (32, 64, 128)


@dataclass(frozen=True)
class Quantization:
    bits: int = 4
    group_size: int = 64
    mode: str = "affine"

    def applies(self, name: str, shape: list[int]) -> bool:
        """A weight is quantized in groups along its input dimension (the last)."""
        return bool(QUANTIZED.search(name)) and shape[-1] % self.group_size == 0


def rename(hf_name: str) -> str | None:
    """A T5 checkpoint's weight name as ours (the demo's training writes Hugging Face's names with it)."""
    return families.T5_FAMILY.rename(hf_name)


# ---------------------------------------------------------------- sources


def download(repo_id: str) -> Path:
    """Only the files conversion needs; safetensors when the repo has them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=CONFIG_FILES + TOKENIZER_FILES + SAFETENSORS_PATTERNS))
        if not any(folder.glob("model*.safetensors")):
            # pytorch_model.bin, or CTranslate2's model.bin (faster-whisper's repos: Systran/faster-whisper-base)
            folder = Path(snapshot_download(repo_id, allow_patterns=CONFIG_FILES + TOKENIZER_FILES + TORCH_PATTERNS
                                            + ["model.bin"]))
    except GatedRepoError:
        raise ConversionError(f"{repo_id} is gated on the Hugging Face hub: accept its terms and run `hf auth login`")
    except RepositoryNotFoundError:
        raise ConversionError(f"{repo_id} is neither a local folder nor a model on the Hugging Face hub")
    except LocalEntryNotFoundError:
        raise ConversionError(f"cannot download {repo_id}: the Hugging Face hub is unreachable (no network?) "
                              "and no copy is cached")
    except (HfHubHTTPError, OSError) as e:
        raise ConversionError(f"cannot download {repo_id}: {str(e).splitlines()[0]}")
    return folder


def resolve_source(model: str) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{model} is a file; give the folder holding a Hugging Face checkpoint")
        return path
    if not could_be_hub_id(model):  # mlx_models/t5-11b, ./mine: a folder that is not there, not a download
        raise ConversionError(f"there is no folder {model} here (and it is not a Hugging Face hub id, like t5-small or "
                              "google/flan-t5-base)")
    return download(model)


def read_source_config(folder: Path) -> dict:
    try:
        config = read_config(folder, converted=False)
    except LoadError as e:
        raise ConversionError(str(e))
    if "quantization" in config:
        q = config["quantization"]
        raise ConversionError(f"{folder} is already quantized ({q.get('bits')}-bit): quantize a float conversion "
                              "or the original checkpoint instead")
    families.family_of(config)  # a model type it takes
    generation = folder / "generation_config.json"
    if generation.is_file():  # transformers 5 keeps the tokens generate forces there, and reads them there first
        try:
            defaults = json.loads(generation.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{generation} is damaged ({e})")
        for key in ("forced_bos_token_id", "forced_eos_token_id"):  # transformers reads them there, over config.json
            if key in defaults:
                config[key] = defaults[key]
        if defaults.get("decoder_start_token_id") is not None:
            config["decoder_start_token_id"] = defaults["decoder_start_token_id"]
    return config


# ---------------------------------------------------------------- mapping


def output_config(config: dict, args: ModelArgs, dtype: str, weight_names: list[str], source: str,
                  quantization: Quantization | None) -> dict:
    """The source's config, with the model's arguments as the family set them (loading needs no families.py)."""
    out = dict(config) | asdict(args)
    if FORMAT_KEY in config:  # converted again: keep the original checkpoint's name
        source = config[FORMAT_KEY].get("source", source)
    out[FORMAT_KEY] = {"dtype": dtype, "source": source, "weight_files": weight_names}
    if quantization is not None:
        out["quantization"] = asdict(quantization)
    return out


class Weights:
    """A checkpoint's weights under our names, as the model takes them: read
    one at a time (`reader`: the source's name -> its tensor), transformed by
    the family (a scaled projection, a reshaped bias), or computed (a
    position table the checkpoint may not store)."""

    def __init__(self, reader, sources: dict[str, str], family: families.Family, args: ModelArgs, tables: dict):
        self.reader, self.sources, self.family, self.args, self.tables = reader, sources, family, args, tables
        self.names = list(sources) + list(tables)

    def shape(self, name: str) -> list[int]:
        if name in self.tables:
            return list(self.tables[name].shape)
        return self.family.shape(name, list(self.reader.shape(self.sources[name])))

    def tensor(self, name: str) -> mx.array:
        if name in self.tables:
            return mx.array(self.tables[name])
        return self.family.transform(name, self.reader.tensor(self.sources[name]), self.args)


def plan(reader, config: dict) -> tuple[Weights, ModelArgs]:
    """Our name -> the source's weight for every weight, checked against the model's shapes.
    The source is a Hugging Face checkpoint of a family families.py knows, or a folder this program wrote."""
    names = set(reader.names())
    ours_already = FORMAT_KEY in config
    family = families.T5_FAMILY if ours_already else families.family_of(config)
    untied = config.get("tie_word_embeddings") is False or config.get("scale_decoder_outputs") is False
    has_lm_head = untied and "lm_head.weight" in names
    if config.get("tie_word_embeddings") is False and not has_lm_head:
        raise ConversionError("the config says the output head is untied (tie_word_embeddings false), "
                              "but the checkpoint has no lm_head.weight")
    args = ModelArgs.from_dict({**config, **({} if ours_already else family.arguments(config)),
                                "tie_word_embeddings": not has_lm_head})
    tables = {} if ours_already else family.tables(config, args)
    sources = {}
    embedding = next((n for n in family.embeddings if n in names), None)
    if embedding is None:
        raise ConversionError("the checkpoint has no token embedding (shared.weight)")
    sources["shared.weight"] = embedding
    for source_name in sorted(names):
        ours = source_name if ours_already else family.rename(source_name)
        if ours is None or ours in tables or ours == "shared.weight" or (ours == "lm_head.weight" and not has_lm_head):
            continue
        sources[ours] = source_name
    weights = Weights(reader, sources, family, args, tables)
    expected = {name: list(p.shape) for name, p in tree_flatten(EncoderDecoder(args).parameters())}
    missing = sorted(set(expected) - set(weights.names))
    if missing:
        raise ConversionError(f"the checkpoint does not match its config: no weight for {missing[0]} ({len(missing)} missing)")
    for ours in weights.names:
        source = sources.get(ours, "a computed table")
        if ours not in expected:
            raise ConversionError(f"unexpected weight {source}: does the config match the checkpoint?")
        if weights.shape(ours) != expected[ours]:
            raise ConversionError(f"{source} has shape {weights.shape(ours)}, the config implies {expected[ours]}")
    return weights, args


# ---------------------------------------------------------------- writing


def outputs(name: str, shape: list[int], dtype, quantization: Quantization | None) -> list[tuple[str, object, list[int]]]:
    """What one weight is written as: (name, dtype, shape) each. A quantized
    weight becomes its packed uint32 values, a scale and a bias per group."""
    if quantization is None or not quantization.applies(name, shape):
        return [(name, dtype, shape)]
    rows, columns = shape
    groups = [rows, columns // quantization.group_size]
    prefix = name.removesuffix(".weight")
    return [(name, mx.uint32, [rows, columns * quantization.bits // 32]),
            (f"{prefix}.scales", dtype, groups), (f"{prefix}.biases", dtype, groups)]


def converted(name: str, array: mx.array, dtype, quantization: Quantization | None) -> list[mx.array]:
    """The arrays `outputs` describes. Quantized from float32, whatever the
    source dtype, so that only the scales and biases are rounded to dtype."""
    if quantization is None or not quantization.applies(name, array.shape):
        return [array.astype(dtype)]
    packed, scales, biases = mx.quantize(array.astype(mx.float32), quantization.group_size, quantization.bits,
                                         mode=quantization.mode)
    return [packed, scales.astype(dtype), biases.astype(dtype)]


def nbytes(name: str, shape: list[int], dtype, quantization: Quantization | None) -> int:
    return sum(dt.size * math.prod(s) for _, dt, s in outputs(name, shape, dtype, quantization))


def shard(weights: Weights, dtype, quantization: Quantization | None) -> list[list[str]]:
    shards, size = [[]], 0
    for name in weights.names:
        size_of = nbytes(name, weights.shape(name), dtype, quantization)
        if shards[-1] and size + size_of > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += size_of
    return shards


def write_shard(path: Path, names: list[str], weights: Weights, dtype, quantization, progress) -> None:
    """A safetensors file written tensor by tensor: the header needs only shapes."""
    header, offset = {}, 0
    for name in names:
        for out_name, out_dtype, shape in outputs(name, weights.shape(name), dtype, quantization):
            size = out_dtype.size * math.prod(shape)
            header[out_name] = {"dtype": SAFETENSORS_DTYPE[out_dtype], "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
    header["__metadata__"] = {"format": "mlx"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in names:
            arrays = converted(name, weights.tensor(name), dtype, quantization)
            for (out_name, _, shape), array in zip(outputs(name, weights.shape(name), dtype, quantization), arrays):
                assert list(array.shape) == shape, (out_name, array.shape, shape)
                if array.dtype == mx.bfloat16:  # numpy has no bfloat16: write its bits
                    array = array.view(mx.uint16)
                data = memoryview(mx.contiguous(array))  # a transposed weight (a convolution's) is laid out anew
                f.write(data)
                progress.update(data.nbytes)
            del arrays, array, data
            mx.clear_cache()


OUTPUT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|" + "|".join(map(re.escape, CONFIG_FILES + TOKENIZER_FILES)))


def is_earlier_conversion(folder: Path) -> bool:
    """A folder convert.py wrote: its config says so, or (config damaged or
    missing) it holds nothing but the files a conversion writes."""
    try:
        return FORMAT_KEY in json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        names = [p.name for p in folder.iterdir()]
        return any(n.endswith(".safetensors") for n in names) and all(OUTPUT_FILE.fullmatch(n) for n in names)


def check_output(out: Path, force: bool) -> None:
    """--force replaces an earlier conversion (or an empty folder), never some other folder."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_file() and not out.is_symlink():
        raise ConversionError(f"{out} is a file: choose another --out")
    if not force:
        raise ConversionError(f"{out} already exists (use --force to replace it)")
    if out.is_symlink() or out.resolve() in (Path.cwd(), *Path.cwd().parents):
        raise ConversionError(f"--force does not replace {out} (a link, or the current folder or one holding it): "
                              "choose another --out")
    if not out.is_dir() or (any(out.iterdir()) and not is_earlier_conversion(out)):
        raise ConversionError(f"{out} exists and is not a converted model: --force only replaces those; choose another --out")


def convert(model: str, out: Path, dtype_name: str, force: bool, quantization: Quantization | None = None) -> Path:
    check_output(out, force)
    source = resolve_source(model)
    if out.resolve() == source.resolve():
        raise ConversionError(f"--out {out} is the folder being converted: choose another")
    written = {}  # the files written from what the source has: a CTranslate2 folder's configs
    if from_ctranslate2.is_ctranslate2_folder(source):
        model_bin = from_ctranslate2.ModelBin(source / "model.bin")
        reader = from_ctranslate2.WhisperReader(model_bin)
        config, written = from_ctranslate2.configs(source, model_bin)
    else:
        config = read_source_config(source)
        if config.get("borrowed_from_target"):  # (demo/train_speech.py's draft: no encoder or embedding of its own)
            raise ConversionError(f"{source} is a draft that borrows its target's weights, converted already: load it "
                                  "as the draft of its target; it cannot be converted again")
        kind, files = weight_files(source)
        reader = SafetensorsReader(files) if kind == "safetensors" else TorchReader(files)
    tokenizer_files = [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    if not tokenizer_files:
        raise ConversionError(f"{source} has no tokenizer files (spiece.model or tokenizer.json)")
    weights, args = plan(reader, config)
    dtype = DTYPES[dtype_name]
    if quantization is not None:
        kept = [name for name in weights.names
                if QUANTIZED.search(name) and not quantization.applies(name, weights.shape(name))]
        if kept:
            print(f"note: {len(kept)} weight(s) stay in {dtype_name}, their input dimension not a multiple of "
                  f"{quantization.group_size}: {', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}", file=sys.stderr)

    with atomic_folder(out, lambda: check_output(out, force)) as partial:
        shards = shard(weights, dtype, quantization)
        total = sum(nbytes(name, weights.shape(name), dtype, quantization) for name in weights.names)
        names = ["model.safetensors"] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]
        what = f"{quantization.bits}-bit" if quantization else dtype_name
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"Converting to {what}") as progress:
            for file_name, shard_names in zip(names, shards):
                write_shard(partial / file_name, shard_names, weights, dtype, quantization, progress)
        for file in tokenizer_files + [source / "generation_config.json", source / "preprocessor_config.json"]:
            if file.is_file():
                shutil.copy(file, partial / file.name)
        for name, contents in written.items():
            (partial / name).write_text(json.dumps(contents, indent=2, ensure_ascii=False))
        tokenizer_config = read_json(source / "tokenizer_config.json")
        # Its class, where transformers' AutoTokenizer looks: tokenizer_config.json, then config.json.
        tokenizer_config["tokenizer_class"] = (tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
                                               or ("MarianTokenizer" if (source / "source.spm").is_file() else None))
        tokenizer = families.write_tokenizer(source, partial, tokenizer_config)
        # config.json last: a folder without it never loads as a model.
        result = output_config(config, args, dtype_name, names, model, quantization)
        if tokenizer is not None:  # ByT5's bytes: no vocabulary (loading.ByteTokenizer)
            result["tokenizer"] = tokenizer
        marked = families.languages(tokenizer_config)
        if marked:  # how the tokenizer marks languages, for --src-lang and --tgt-lang
            result["languages"] = marked
        (partial / "config.json").write_text(json.dumps(result, indent=2))
    return out


def read_json(path: Path) -> dict:
    """A JSON file's object; {} when there is none (or it is not one)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def default_out(model: str, quantization: Quantization | None = None) -> Path:
    """mlx_models/<the folder's or the hub repo's name>, with -<bits>bit when quantized."""
    path = Path(model).expanduser()
    name = path.resolve().name if path.exists() else model.rstrip("/").rpartition("/")[2]
    if not name:
        raise ConversionError(f"cannot name an output folder after {model!r}: give --out")
    return Path("mlx_models") / (name + (f"-{quantization.bits}bit" if quantization else ""))


class Terminated(BaseException):
    """SIGTERM, raised where the conversion is, so that it cleans up as after Ctrl-C."""


def terminate(signum, frame):
    raise Terminated()


def quantization_of(args) -> Quantization | None:
    """The --quantize options, checked: one line for a bad value, not argparse's usage block."""
    bits = Quantization.bits if args.q_bits is None else args.q_bits
    group_size = Quantization.group_size if args.q_group_size is None else args.q_group_size
    if bits not in Q_BITS:
        raise ConversionError(f"--q-bits must be one of {', '.join(map(str, Q_BITS))} (got {bits})")
    if group_size not in Q_GROUP_SIZES:
        raise ConversionError(f"--q-group-size must be one of {', '.join(map(str, Q_GROUP_SIZES))} (got {group_size})")
    if not args.quantize:
        if args.q_bits is not None or args.q_group_size is not None:
            raise ConversionError("--q-bits and --q-group-size go with -q/--quantize")
        return None
    return Quantization(bits, group_size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face hub id (t5-small, google/flan-t5-large, ...) or local checkpoint folder "
                             "(a faster-whisper model's too: CTranslate2's model.bin)")
    parser.add_argument("--out", type=Path, help="output folder (default: mlx_models/<name>)")
    parser.add_argument("--dtype", choices=DTYPES, default=default_dtype(),
                        help="dtype of the weights kept in float (default: bfloat16 on a Mac's GPU, T5's training dtype; "
                             "float32 on a CPU, where MLX has no fast half-precision products)")
    parser.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    parser.add_argument("-q", "--quantize", action="store_true",
                        help="quantize the projections, embedding and head (default output: mlx_models/<name>-<bits>bit)")
    parser.add_argument("--q-bits", type=int, help=f"bits per quantized weight: {', '.join(map(str, Q_BITS))} (default 4)")
    parser.add_argument("--q-group-size", type=int,
                        help=f"weights sharing a scale and bias: {', '.join(map(str, Q_GROUP_SIZES))} (default 64)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, terminate)
    try:
        quantization = quantization_of(args)
        out = args.out or default_out(args.model, quantization)
        convert(args.model, out, args.dtype, args.force, quantization)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2  # as main.py's
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated: nothing was written", file=sys.stderr)
        return 143
    what = f"{quantization.bits}-bit, groups of {quantization.group_size}, the rest {args.dtype}" if quantization else args.dtype
    print(f"Saved {out} ({what}). Try it: {try_it(out)}")
    return 0


def try_it(out: Path) -> str:
    """The command that runs what was converted: a speech model (Whisper) takes audio files, a text model a prompt."""
    if read_config(out).get("num_mel_bins"):
        return (f"python main.py --model {out} --audio FILE "
                "(drafted by a distil-whisper of the same tokenizer: --draft-model DRAFT)")
    return f"python main.py --model {out} --regular-decode (or as a speculative pair: --model TARGET --draft-model DRAFT)"


if __name__ == "__main__":
    sys.exit(main())
