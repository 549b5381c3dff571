"""Reading converted models: find a folder by name, check it, load its T5 and tokenizer.

    models = load("t5-11b-4bit", draft="t5-small")   # what generate() and friends take
    model = load_model("mlx_models/t5-small")         # one folder's T5, ready to decode

A converted folder is what convert.py writes: config.json (with the
`mlx_conversion` entry that marks it ours), safetensors shards and the
tokenizer. Every problem a user can fix is a `LoadError` naming what to do.
"""

import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import cpu  # before mlx.core
import kernels
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from errors import LoadError, ModelNotFound
from languages import Languages
from model import EncoderDecoder, ModelArgs
import pipeline

FORMAT_KEY = "mlx_conversion"  # marks a config.json written by convert.py
MODELS_DIR = Path("mlx_models")  # where convert.py writes by default
REPOSITORY = Path(__file__).resolve().parent


def read_config(folder: str | Path, converted: bool = True) -> dict:
    """A folder's config.json: a conversion's (LoadError if convert.py did
    not write it) or, with converted=False, a Hugging Face checkpoint's."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise LoadError(f"{folder} is not a folder")
    if not config_file.is_file():
        raise LoadError(f"{folder} has no config.json: not a converted model" if converted else
                        f"{folder} holds no Hugging Face checkpoint (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{config_file} is damaged ({e})" + (": convert the model again" if converted else ""))
    if not isinstance(config, dict):
        raise LoadError(f"{config_file} is damaged (not a JSON object)")
    if converted and FORMAT_KEY not in config:
        raise LoadError(f"{folder} is not a converted MLX model "
                        f"(a Hugging Face checkpoint? run: python convert.py --model {folder})")
    return config


def hears_speech(name: str | Path, role: str = "target") -> bool:
    """Whether a converted model (a folder, a name under mlx_models/ or the hub id it was converted from, as load
    takes) transcribes speech (Whisper: log-mel frames in) rather than reads text; its weights are not read."""
    return bool(read_config(resolve(name, role)).get("num_mel_bins"))


def could_be_hub_id(name: str) -> bool:
    """Whether convert.py could download this name (ORG/REPO or REPO), as
    against a path on this machine (under mlx_models/, or in a folder here)."""
    parts = name.split("/")
    if len(parts) == 2 and (parts[0] == MODELS_DIR.name or Path(parts[0]).is_dir()):
        return False
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~")) and \
        all(c.isalnum() or c in "-_." for part in parts for c in part)


def resolve(name: str | Path, role: str = "model") -> Path:
    """The converted folder a name means: a path; else mlx_models/NAME; else,
    for a hub id ORG/REPO, the mlx_models/REPO that convert.py made from that
    very id. A relative name is looked up from the current folder, then from
    this repository's. `role` ("target", "draft") names the model in errors."""
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"the {role} must be a folder or a name (got {type(name).__name__})")
    name = str(name)
    if not name.strip():
        raise ModelNotFound(f"no {role} named", role)
    path = Path(name).expanduser()
    bases = [Path()]
    if not path.is_absolute() and Path.cwd().resolve() != REPOSITORY:
        bases.append(REPOSITORY)
    candidates = list(dict.fromkeys(base / sub / path for base in bases for sub in (Path(), MODELS_DIR)))
    problem = None
    for folder in candidates:
        if folder.is_dir():
            try:
                read_config(folder)
                return folder
            except LoadError as e:
                problem = problem or e
    org, _, repo = name.partition("/")
    if org and repo and "/" not in repo:  # a hub id: convert.py wrote mlx_models/REPO and recorded the id
        for base in bases:
            folder = base / MODELS_DIR / repo
            try:
                if read_config(folder)[FORMAT_KEY].get("source") == name:
                    return folder
            except LoadError:
                pass
    if problem:
        raise problem
    if path.is_file():
        raise LoadError(f"{role} {name} is a file: give a folder written by convert.py")
    looked = " and ".join(str(folder) for folder in candidates)
    raise ModelNotFound(f"no converted {role} '{name}' (looked for {looked}): {conversion_advice(name)}", role)


def conversion_advice(name: str) -> str:
    """How to make the converted folder a name means: convert.py's command."""
    # convert.py writes a quantized conversion of NAME to mlx_models/NAME-<bits>bit
    base, _, bits = name.removeprefix(f"{MODELS_DIR.name}/").rpartition("-")
    if base and bits in {f"{b}bit" for b in (2, 3, 4, 5, 6, 8)} and could_be_hub_id(base):
        return f"run `python convert.py --model {base} -q{'' if bits == '4bit' else ' --q-bits ' + bits[:-3]}` first"
    if could_be_hub_id(name):
        return f"run `python convert.py --model {name}` first"
    # a path: convert.py cannot download it, but can write there
    return f"convert a checkpoint there first: `python convert.py --model <hub id or checkpoint folder> --out {name}`"


def load_model(folder: str | Path, one_row: bool = False) -> EncoderDecoder:
    """A converted folder's T5, checked against its config, every weight read
    and decoding compiled. In a quantized folder (its config says
    "quantization"), the layers with `.scales` are quantized ones. On the CPU
    path, decoding's products run on every core, and with `one_row` (each
    step will decode one row: regular decoding, one prompt at a time) take
    the weight layout fastest there (cpu.use_cores)."""
    return _mapped(Path(folder), one_row).compile_decoding()  # compiling reads every weight


def _mapped(folder: Path, one_row: bool = False, lender: EncoderDecoder | None = None, link=None,
            split: list[tuple[int, int]] | None = None) -> EncoderDecoder:
    """load_model's model before its weights are read: mx.load maps the
    safetensors lazily (never copying through numpy), so a folder is checked
    in moments and read afterwards. A draft whose config names weights
    `borrowed_from_target` (demo/train_speech.py's: the encoder and the token
    embedding) has those modules of its target, `lender`: the same arrays.
    With a `link` (pipeline.join), only this rank's stage of the layers, cut as `split` says (each stage's
    (encoder, decoder) layer counts) or, without one, where the layers' bytes come out even."""
    config = read_config(folder)
    model = (pipeline.Pipeline if link and link.rank == 0 else EncoderDecoder)(ModelArgs.from_dict(config))
    borrowed = config.get("borrowed_from_target") or []
    if borrowed and getattr(lender, "link", None) is not None:
        raise LoadError(f"{folder} borrows its target's {' and '.join(borrowed)}, which is split into stages here: "
                        "run it on one machine, or give a draft of its own")
    if borrowed and lender is None:
        raise LoadError(f"{folder} is a draft that borrows its target's {' and '.join(borrowed)}: load it as the "
                        "draft of its target (--draft-model)")
    weights = {}
    for path in (folder / name for name in config[FORMAT_KEY]["weight_files"]):
        try:
            weights.update(mx.load(str(path)))
        except RuntimeError as e:  # missing, truncated or corrupt
            raise LoadError(f"{path} cannot be read ({e}): convert the model again")
    if link is not None:
        weights = pipeline.place(model, weights, link, split)
        model.link = link
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model, q["group_size"], q["bits"], mode=q.get("mode", "affine"),
                    class_predicate=lambda path, module: f"{path}.scales" in weights)
    shape = ("d_model", "vocab_size", "num_layers", "num_heads", "d_kv", "d_ff", "num_mel_bins", "encoder_positions")
    if borrowed and any(getattr(model.args, key) != getattr(lender.args, key) for key in shape):
        key = next(key for key in shape if getattr(model.args, key) != getattr(lender.args, key))
        raise LoadError(f"{folder} borrows its target's {' and '.join(borrowed)}, but its {key} is "
                        f"{getattr(model.args, key)} and the target's {getattr(lender.args, key)}: not its target")
    for name in borrowed:
        setattr(model, name, getattr(lender, name))
        weights |= {f"{name}.{key}": value for key, value in tree_flatten(getattr(lender, name).parameters())}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # a weight missing, extra or of the wrong shape
        detail = " ".join(str(e).split())  # one line: MLX lists the names on lines of their own
        raise LoadError(f"{folder}'s weights do not match its config ({detail[:200]}): convert the model again")
    model.eval()
    return cpu.use_cores(model, one_row)


class Tokenizer:
    """A converted model's tokenizer, read from its tokenizer.json with the
    `tokenizers` library: starting up imports neither transformers nor PyTorch.
    It encodes as transformers' T5 tokenizer does (EOS appended) and decodes
    special tokens as text unless asked to skip them, without "cleaning up" spaces."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Rust

        self.backend = Rust.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def added_tokens(self) -> dict[str, int]:
        """The tokens added to the model's vocabulary (special ones: language codes, sentinels)."""
        return {token.content: index for index, token in self.backend.get_added_tokens_decoder().items()}

    def special_ids(self) -> set[int]:
        """The ids decode leaves out with skip_special_tokens."""
        return {index for index, token in self.backend.get_added_tokens_decoder().items() if token.special}

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


class ByteTokenizer:
    """ByT5's tokenizer, which has no vocabulary file: a text's UTF-8 bytes,
    each its value + 3 (after pad, EOS and unk), and the sentinels
    <extra_id_N> after the bytes; as transformers' ByT5Tokenizer encodes
    and decodes (an incomplete character decodes as nothing)."""

    specials = ("<pad>", "</s>", "<unk>")

    def __init__(self, extra_ids: int = 125):
        self.extra = {f"<extra_id_{i}>": 259 + i for i in range(extra_ids)}
        names = {**{name: i for i, name in enumerate(self.specials)}, **self.extra}
        self.pattern = re.compile("|".join(f"\\s*{re.escape(n)}\\s*" if n in self.specials else re.escape(n)
                                           for n in sorted(names, key=len, reverse=True)))
        self.names, self.by_id = names, {i: name for name, i in names.items()}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, at = [], 0
        for found in self.pattern.finditer(text):  # pad, EOS and unk take the spaces around them, as transformers'
            ids += [b + 3 for b in text[at : found.start()].encode("utf-8")] + [self.names[found.group().strip()]]
            at = found.end()
        ids += [b + 3 for b in text[at:].encode("utf-8")]
        return ids + [1] if add_special_tokens and ids[-1:] != [1] else ids  # an EOS given ends it, as transformers

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_) -> str:
        out = b""
        for i in ids:
            if 3 <= i < 259:
                out += bytes([i - 3])
            elif i in self.by_id and not skip_special_tokens:
                out += self.by_id[i].encode("utf-8")
        return out.decode("utf-8", errors="ignore")

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(b): b + 3 for b in range(256)}, **self.names}

    def special_ids(self) -> set[int]:
        """The ids decode leaves out with skip_special_tokens."""
        return set(self.by_id)

    def __len__(self) -> int:
        return 259 + len(self.extra)


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer: from tokenizer.json (convert.py writes one),
    bytes for ByT5 (its config says so); for a folder with only
    spiece.model, transformers' (a slower start)."""
    folder = Path(folder)
    marked = read_config(folder).get("tokenizer") if (folder / "config.json").is_file() else None
    if marked and marked.get("kind") == "bytes":
        return ByteTokenizer(marked.get("extra_ids", 125))
    if (folder / "tokenizer.json").is_file():
        try:
            return Tokenizer(folder / "tokenizer.json")
        except Exception as e:  # the Rust library's errors have no common type
            raise LoadError(f"{folder} has a damaged tokenizer.json ({str(e).splitlines()[0]}): convert the model again")
    # Without these files transformers quietly builds a tokenizer of special tokens only.
    if not (folder / "spiece.model").is_file():
        raise LoadError(f"{folder} has no tokenizer (tokenizer.json or spiece.model): convert the model again")
    from transformers import AutoTokenizer  # slow import: only when needed

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise LoadError(f"{folder} has a damaged tokenizer ({str(e).splitlines()[0]}): convert the model again")


@dataclass
class Learned:
    """What decoding learns of a pair from one generation to the next:
    `drafting`, what num-draft auto has learnt (autodraft.AutoDraft, made when
    auto first runs); `encoding_rate`, the flops a second a prompt was last
    encoded at (generate.encoding_seconds), None until a prompt takes long
    enough to tell."""

    drafting: object = None
    encoding_rate: float | None = None


@dataclass
class Models:
    """A target, its draft (None: regular decoding only) and their shared
    tokenizer, as loaded, with what their configs say, and (`learned`) what
    decoding learns of them while running. `load` makes one; tests and
    benchmarks may build one from models in hand."""

    target: EncoderDecoder
    draft: EncoderDecoder | None = None
    tokenizer: object = None
    target_path: Path | None = None
    draft_path: Path | None = None
    tasks: dict = field(default_factory=dict)  # the target's config's task_specific_params (options.task_preset)
    languages: Languages | None = None  # a multilingual target's language codes
    generation: dict = field(default_factory=dict)  # the target's generation_config.json (plans.generation_defaults)
    learned: Learned = field(default_factory=Learned, repr=False)

    @property
    def longest_input(self) -> int | None:
        """The most positions a prompt or an output may take in either model (T5.longest_input); None: no end."""
        ends = [model.longest_input for model in (self.target, self.draft) if model is not None and model.longest_input]
        return min(ends) if ends else None


def check_fit(path: Path, model: EncoderDecoder, tokenizer) -> None:
    """Warn, once per model, of what would make its output empty or slow."""
    # T5 pads its vocabulary to a multiple of 128 (32128 rows for 32100 pieces);
    # beyond that, the model can choose tokens the tokenizer prints as nothing.
    known = -(-len(tokenizer) // 128) * 128
    if model.args.vocab_size > known:
        warnings.warn(f"{path} has {model.args.vocab_size:,} output tokens but its tokenizer only {len(tokenizer):,}: "
                      "tokens past those print as nothing (a tokenizer from another model?)", RuntimeWarning, stacklevel=3)
    dtype = model.shared.weight.dtype if not hasattr(model.shared, "scales") else model.shared.scales.dtype
    if cpu.in_use() and dtype in (mx.bfloat16, mx.float16):
        warnings.warn(f"{path} is {str(dtype).split('.')[-1]}: MLX's CPU backend has no fast half-precision products, "
                      "it decodes several times slower than float32 (convert with --dtype float32)", RuntimeWarning, stacklevel=3)


SPECIAL_TOKENS = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "forced_bos_token_id", "forced_eos_token_id")


def tokenizer_difference(target_config: dict, target_tokenizer, draft_config: dict, draft_tokenizer) -> str | None:
    """The first way a draft's tokens differ from its target's, by what they
    are, not by name: the output vocabulary's size, the special tokens the
    configs name, then each token of the vocabularies."""
    if draft_config["vocab_size"] != target_config["vocab_size"]:
        return f"it has {draft_config['vocab_size']:,} output tokens, the target {target_config['vocab_size']:,}"
    for key in SPECIAL_TOKENS:
        if draft_config.get(key) != target_config.get(key):
            return f"its {key} is {draft_config.get(key)}, the target's {target_config.get(key)}"
    theirs, ours = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    for token, index in sorted(theirs.items(), key=lambda item: item[1]):
        if ours.get(token) != index:
            where = "has no such token" if token not in ours else f"has it as {ours[token]}"
            return f"the target's token {index} is {token!r}, which the draft's tokenizer {where}"
    extra = sorted(set(ours) - set(theirs), key=ours.get)
    return f"its tokenizer has {extra[0]!r} ({ours[extra[0]]}), the target's none" if extra else None


_warned_slow_blas = False


def load(target: str | Path, *, draft: str | Path | None = None, verbose: bool = False, one_row: bool = False,
         stages: int | list[tuple[int, int]] | None = None) -> Models:
    """Load a converted target (and draft) by folder, name under mlx_models/,
    or the hub id it was converted from. Every weight is read now (verbose:
    saying so on stderr), so the first generation's time is decoding, not
    disk reads. A draft must share the target's tokenizer; that is checked
    before any weights load. `one_row`: the target will decode one row a
    step, regular decoding of one prompt at a time (load_model).
    `stages`: the target split over that many ranks of `mlx.launch` (or
    stages of these (encoder layers, decoder layers) counts), pipeline.py.
    On rank 0 this returns as ever; on the others it computes its stage
    until rank 0's program ends, then ends the process."""
    global _warned_slow_blas
    target_path = resolve(target, "target")
    link = pipeline.join(target_path, stages) if pipeline.count(stages) > 1 else None  # (one stage: the whole target)
    split = stages if isinstance(stages, (list, tuple)) else None
    if link is not None:  # rank 0 ends the others as its program ends; they compute their stage until then
        if link.rank > 0:  # (no draft, no tokenizer: those are rank 0's)
            pipeline.serve_or_exit(_mapped(target_path, one_row, link=link, split=split).compile_decoding(), link)
        pipeline.serve_or_exit(None, link)
    draft_path = resolve(draft, "draft") if draft is not None else None
    tokenizer = load_tokenizer(target_path)
    if draft_path is not None:
        difference = tokenizer_difference(read_config(target_path), tokenizer, read_config(draft_path),
                                          load_tokenizer(draft_path))
        if difference:
            raise LoadError(f"{draft} is not a draft for {target}: {difference} (a draft must share the target's tokenizer)")
    if cpu.SLOW and not _warned_slow_blas:  # once per process, whatever the warning filters say
        _warned_slow_blas = True
        advice = ": several times slower; import this project's modules before mlx.core" if cpu.ACTIVE == cpu.MLX_FIRST else ""
        warnings.warn(f"MLX's CPU backend runs on its {cpu.ACTIVE}{advice}", RuntimeWarning, stacklevel=2)
    target_model = _mapped(target_path, one_row, link=link, split=split)
    draft_model = _mapped(draft_path, lender=target_model) if draft_path is not None else None
    if draft_model is not None and same_encoder(target_model, draft_model):
        # distil-whisper's drafts keep their target's encoder: the draft decodes on the target's encoder output, and
        # its own copy (read once, for the comparison) is dropped
        draft_model.encoder = target_model.encoder
        if target_model.args.num_mel_bins:
            draft_model.stem = target_model.stem
    if verbose:  # on stderr: stdout may carry a program's output (main.py --json)
        names = [os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
                 for path in (target_path, draft_path) if path is not None]
        print(f"Loading {' and '.join(names)} ...", file=sys.stderr, flush=True)
        if (folder := kernels.uncompiled_kernels()) is not None:
            print(f"First run of MLX {mx.__version__} here: its CPU kernels are compiled as they are first needed "
                  f"(once, kept in {folder}), which slows the first generation by up to half a minute.",
                  file=sys.stderr, flush=True)
    for path, model in ((target_path, target_model), (draft_path, draft_model)):
        if model is not None:
            model.compile_decoding()  # reads every weight
            check_fit(path, model, tokenizer)
    config = read_config(target_path)
    return Models(target_model, draft_model, tokenizer, target_path.resolve(), draft_path and draft_path.resolve(),
                  tasks=config.get("task_specific_params") or {}, languages=Languages.of(config, tokenizer),
                  generation=read_generation_config(target_path))


def same_encoder(target: EncoderDecoder, draft: EncoderDecoder) -> bool:
    """Whether the draft's encoder (and input layer, for speech) is the target's, weight for weight. Text models'
    encoders read the shared token embedding, which the draft keeps: only speech's encoders can be shared."""
    if not target.args.num_mel_bins or target.args.num_mel_bins != draft.args.num_mel_bins:
        return False
    ours, theirs = (dict(tree_flatten({"encoder": m.encoder.parameters(), "stem": m.stem.parameters()}))
                    for m in (target, draft))
    return ours.keys() == theirs.keys() and all(
        a.shape == theirs[name].shape and a.dtype == theirs[name].dtype and mx.array_equal(a, theirs[name]).item()
        for name, a in ours.items())


def read_generation_config(folder: Path) -> dict:
    """A converted folder's generation_config.json (convert.py copies the checkpoint's), or {} where it has none."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        generation = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{path} is damaged ({e}): convert the model again")
    return generation if isinstance(generation, dict) else {}
