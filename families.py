"""The encoder-decoder families convert.py takes, each a configuration of model.py's one model.

A `Family` says, for the checkpoints whose config names one of its
model_types: which of model.ModelArgs' switches its config sets, how its
weight names map to ours, and what a checkpoint does not store as we use
it: position tables computed from a formula, the queries' scaling folded
into their projection (our attention scales by 1, as T5's), the logits'
bias as a vector.

- T5 and its descendants (v1.0, v1.1, FLAN-T5, mT5, ByT5, MADLAD-400, UL2:
  model_type t5 or mt5; umT5, whose layers each have their own relative
  position bias);
- the BART family, one layout with a handful of switches: BART and mBART
  (learned positions from row 2, a norm after the embeddings), Marian and
  Pegasus (sinusoidal positions), M2M-100 and NLLB (sinusoidal, from row
  2); BART and Marian normalise each block's output, the others its input.
"""

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from errors import ConversionError

# ---------------------------------------------------------------- T5

T5_LAYERS = (
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.", r"encoder.layers.\1.attention."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"encoder.layers.\1.attention_norm."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.", r"encoder.layers.\1.ffn."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"encoder.layers.\1.ffn_norm."),
    (r"^decoder\.block\.(\d+)\.layer\.0\.SelfAttention\.", r"decoder.layers.\1.self_attention."),
    (r"^decoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"decoder.layers.\1.self_attention_norm."),
    (r"^decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.", r"decoder.layers.\1.cross_attention."),
    (r"^decoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"decoder.layers.\1.cross_attention_norm."),
    (r"^decoder\.block\.(\d+)\.layer\.2\.DenseReluDense\.", r"decoder.layers.\1.ffn."),
    (r"^decoder\.block\.(\d+)\.layer\.2\.layer_norm\.", r"decoder.layers.\1.ffn_norm."),
    (r"^(encoder|decoder)\.final_layer_norm\.", r"\1.final_norm."),
    (r"^(shared|lm_head)\.weight$", r"\1.weight"),
)
T5_RENAMES = ((r"^(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.",
               r"\1.relative_attention_bias.embeddings."),) + T5_LAYERS
UMT5_RENAMES = ((r"^(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.",
                 r"\1.layers.\2.relative_attention_bias.embeddings."),) + T5_LAYERS  # every layer its own


def t5_arguments(config: dict) -> dict:
    # transformers >= 5 always writes tie_word_embeddings=True and keeps the v1.0 head scaling in
    # scale_decoder_outputs; older configs signal both with tie_word_embeddings (False for v1.1).
    scale = config.get("scale_decoder_outputs", config.get("tie_word_embeddings", True) is not False)
    return {"scale_decoder_outputs": bool(scale)} | ({"positions": "relative per layer"} if config.get("model_type") == "umt5"
                                                     else {})


# ---------------------------------------------------------------- BART

_MODEL = r"^(?:model\.)?"  # BartForConditionalGeneration's prefix; BartModel's checkpoints have none
BART_RENAMES = (
    (_MODEL + r"shared\.weight$", r"shared.weight"),
    (_MODEL + r"(encoder|decoder)\.embed_positions\.weight$", r"\1.positions.weight"),
    (_MODEL + r"(encoder|decoder)\.layernorm_embedding\.", r"\1.embedding_norm."),
    (_MODEL + r"(encoder|decoder)\.layer_norm\.", r"\1.final_norm."),
    (_MODEL + r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"encoder.layers.\1.attention.\2."),
    (_MODEL + r"encoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"encoder.layers.\1.attention.o."),
    (_MODEL + r"encoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"encoder.layers.\1.attention_norm."),
    (_MODEL + r"decoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"decoder.layers.\1.self_attention.\2."),
    (_MODEL + r"decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"decoder.layers.\1.self_attention.o."),
    (_MODEL + r"decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"decoder.layers.\1.self_attention_norm."),
    (_MODEL + r"decoder\.layers\.(\d+)\.encoder_attn\.([qkv])_proj\.", r"decoder.layers.\1.cross_attention.\2."),
    (_MODEL + r"decoder\.layers\.(\d+)\.encoder_attn\.out_proj\.", r"decoder.layers.\1.cross_attention.o."),
    (_MODEL + r"decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.", r"decoder.layers.\1.cross_attention_norm."),
    (_MODEL + r"(encoder|decoder)\.layers\.(\d+)\.fc1\.", r"\1.layers.\2.ffn.wi."),
    (_MODEL + r"(encoder|decoder)\.layers\.(\d+)\.fc2\.", r"\1.layers.\2.ffn.wo."),
    (_MODEL + r"(encoder|decoder)\.layers\.(\d+)\.final_layer_norm\.", r"\1.layers.\2.ffn_norm."),
    (r"^final_logits_bias$", r"final_logits_bias"),
    (r"^lm_head\.weight$", r"lm_head.weight"),
)

@dataclass(frozen=True)
class BartKind:
    """What sets one of the BART family's model types apart."""

    pre_norm: bool  # each block normalises its input (else the sum of its input and output)
    learned_positions: bool  # a position table in the checkpoint (else sinusoids, computed here)
    position_offset: int  # the table's row for position 0
    embedding_norm: bool  # a norm after the embeddings
    logits_bias: bool = True  # final_logits_bias


BART_KINDS = {
    "bart": BartKind(pre_norm=False, learned_positions=True, position_offset=2, embedding_norm=True),
    "mbart": BartKind(pre_norm=True, learned_positions=True, position_offset=2, embedding_norm=True),
    "marian": BartKind(pre_norm=False, learned_positions=False, position_offset=0, embedding_norm=False),
    "pegasus": BartKind(pre_norm=True, learned_positions=False, position_offset=0, embedding_norm=False),
    "m2m_100": BartKind(pre_norm=True, learned_positions=False, position_offset=2, embedding_norm=False, logits_bias=False),
}


def bart_arguments(config: dict) -> dict:
    kind = config["model_type"]
    switches = BART_KINDS[kind]
    pre_norm, offset = switches.pre_norm, switches.position_offset
    d_model, heads = config["d_model"], config["encoder_attention_heads"]
    if (config.get("decoder_attention_heads", heads), config.get("decoder_ffn_dim", config["encoder_ffn_dim"])) != \
            (heads, config["encoder_ffn_dim"]):
        raise ConversionError("the encoder and the decoder differ in heads or FFN width: not a model this converts")
    if kind == "marian" and config.get("share_encoder_decoder_embeddings", True) is False:
        raise ConversionError("this Marian model has separate source and target vocabularies: not one this converts")
    return {"vocab_size": config["vocab_size"], "d_model": d_model, "d_kv": d_model // heads, "num_heads": heads,
            "d_ff": config["encoder_ffn_dim"], "num_layers": config["encoder_layers"],
            "num_decoder_layers": config["decoder_layers"], "layer_norm_epsilon": 1e-5,
            "feed_forward_proj": config.get("activation_function", "gelu"),
            "tie_word_embeddings": config.get("tie_word_embeddings", True), "scale_decoder_outputs": False,
            "positions": "absolute", "position_offset": offset,
            "max_positions": config["max_position_embeddings"] + offset, "norm": "layer", "pre_norm": pre_norm,
            "final_norm": pre_norm, "embedding_norm": switches.embedding_norm,
            "embedding_scale": math.sqrt(d_model) if config.get("scale_embedding") else 1.0, "linear_bias": True,
            "logits_bias": switches.logits_bias}


def sinusoidal(rows: int, dim: int) -> np.ndarray:
    """Marian's and Pegasus' table: sines of every other frequency, then their cosines."""
    position = np.arange(rows)[:, None] / np.power(10000, 2 * (np.arange(dim) // 2) / dim)[None]
    half = dim // 2 + dim % 2
    table = np.empty((rows, dim))
    table[:, :half], table[:, half:] = np.sin(position[:, 0::2]), np.cos(position[:, 1::2])
    return table.astype(np.float32)


def fairseq_sinusoidal(rows: int, dim: int, padding_row: int) -> np.ndarray:
    """M2M-100's and NLLB's table (fairseq's): sines then cosines of half the
    frequencies; the padding's row zero. The frequencies and angles are
    float32 products, as transformers makes them; each exp, sin and cos is
    taken in float64 and rounded once, so the table is as near the exact one
    as transformers' own whatever numpy's float32 kernels on this CPU do
    (theirs came further, and differed from transformers' table by an ulp in
    a frequency wherever the two libraries round apart: a position of 200
    turns that into 1.5e-5)."""
    half = dim // 2
    exponents = np.arange(half, dtype=np.float32) * np.float32(-math.log(10000) / (half - 1))
    frequencies = np.exp(exponents.astype(np.float64)).astype(np.float32)
    angles = (np.arange(rows, dtype=np.float32)[:, None] * frequencies[None]).astype(np.float64)
    table = np.concatenate([np.sin(angles), np.cos(angles), np.zeros((rows, dim % 2))], axis=1).astype(np.float32)
    table[padding_row] = 0
    return table


def bart_tables(config: dict, args) -> dict[str, np.ndarray]:
    """The sinusoidal families' position tables, which checkpoints may or may not store."""
    kind = config["model_type"]
    if BART_KINDS[kind].learned_positions:  # in the checkpoint
        return {}
    if kind == "m2m_100":
        table = fairseq_sinusoidal(args.max_positions, args.d_model, config["pad_token_id"])
    else:
        table = sinusoidal(args.max_positions, args.d_model)
    return {"encoder.positions.weight": table, "decoder.positions.weight": table}


# ---------------------------------------------------------------- Whisper

WHISPER_RENAMES = ((r"^(?:model\.)?encoder\.conv([12])\.", r"stem.conv\1."),
                   (r"^proj_out\.weight$", None)) + BART_RENAMES  # the head: the token embedding, tied


def whisper_arguments(config: dict) -> dict:
    """Whisper: the BART family's layout with pre-norm LayerNorms, an audio stem for its input, a sinusoidal table
    for the encoder's positions (in the checkpoint) and a learned one, shorter, for the decoder's."""
    d_model, heads = config["d_model"], config["encoder_attention_heads"]
    if (config.get("decoder_attention_heads", heads), config.get("decoder_ffn_dim", config["encoder_ffn_dim"])) != \
            (heads, config["encoder_ffn_dim"]):
        raise ConversionError("the encoder and the decoder differ in heads or FFN width: not a model this converts")
    return {"vocab_size": config["vocab_size"], "d_model": d_model, "d_kv": d_model // heads, "num_heads": heads,
            "d_ff": config["encoder_ffn_dim"], "num_layers": config["encoder_layers"],
            "num_decoder_layers": config["decoder_layers"], "layer_norm_epsilon": 1e-5,
            "feed_forward_proj": config.get("activation_function", "gelu"), "tie_word_embeddings": True,
            "scale_decoder_outputs": False, "positions": "absolute", "position_offset": 0,
            "max_positions": config["max_target_positions"], "encoder_positions": config["max_source_positions"],
            "norm": "layer", "pre_norm": True, "final_norm": True, "embedding_norm": False, "embedding_scale": 1.0,
            "linear_bias": True, "logits_bias": False, "num_mel_bins": config["num_mel_bins"]}


def whisper_tables(config: dict, args) -> dict[str, np.ndarray]:
    """Whisper's keys are projected without a bias, ours with one: zeros."""
    zeros = np.zeros(args.num_heads * args.d_kv, np.float32)
    names = [f"encoder.layers.{i}.attention.k.bias" for i in range(args.num_layers)]
    names += [f"decoder.layers.{i}.{kind}.k.bias" for i in range(args.num_decoder_layers)
              for kind in ("self_attention", "cross_attention")]
    return dict.fromkeys(names, zeros)


# ---------------------------------------------------------------- Marian's tokenizer

HIDDEN = "\u0000"  # before a piece the source's model lacks: no text holds it, so only decoding reaches the piece


def marian_tokenizer(folder):
    """A tokenizer.json's Tokenizer for Marian's two SentencePiece models
    (source.spm, target.spm) over one vocabulary (vocab.json), which
    transformers has no fast form of: ids are the vocabulary's; a text
    encodes into the source model's pieces with its scores and normaliser
    (the target's own pieces are out of reach behind HIDDEN), then </s>;
    ids decode into any piece, as SentencePiece joins them. Language codes
    (>>fra<<) are split off first, as MarianTokenizer does."""
    import json

    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    vocab = json.loads((folder / "vocab.json").read_text())
    source = spm.SentencePieceProcessor(model_file=str(folder / "source.spm"))
    scores = {source.id_to_piece(i): source.get_score(i) for i in range(source.get_piece_size()) if not source.is_unknown(i)}
    ordered = sorted(vocab, key=vocab.get)
    if [vocab[piece] for piece in ordered] != list(range(len(ordered))):
        raise ConversionError(f"{folder / 'vocab.json'} does not number its pieces 0 to {len(ordered) - 1}")
    codes = [piece for piece in ordered if piece.startswith(">>") and piece.endswith("<<")]
    specials = [token for token in ("</s>", "<unk>", "<pad>") if token in vocab]
    named = set(scores) | set(codes) | set(specials)
    floor = min(scores.values())
    tokenizer = Tokenizer(models.Unigram([(p, scores.get(p, floor)) if p in named else (HIDDEN + p, floor) for p in ordered],
                                         vocab.get("<unk>", 0), byte_fallback=False))
    spm_text(tokenizer, folder / "source.spm")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(HIDDEN, ""), tokenizer.decoder])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.add_tokens([AddedToken(code, special=False) for code in codes])
    return tokenizer


def spm_text(tokenizer, spm_file) -> None:
    """Give tokenizer a SentencePiece model's text handling: its normaliser
    (the precompiled character map; no spaces at either end and one between
    words), words marked with its meta space, and decoding that joins them."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(spm_file.read_bytes())
    charsmap = proto.normalizer_spec.precompiled_charsmap
    steps = [normalizers.Precompiled(charsmap)] if charsmap else []
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")


# ---------------------------------------------------------------- M2M-100's tokenizer


def m2m100_tokenizer(folder, tokenizer_config: dict):
    """A tokenizer.json's Tokenizer for M2M-100's SentencePiece BPE model
    (sentencepiece.bpe.model) read through fairseq's dictionary (vocab.json),
    which transformers has no fast form of: the model's merges make the
    pieces, vocab.json numbers them, the language codes (__fr__) follow the
    dictionary's ids as special tokens (as the hub's tokenizer configs list
    them); a text encodes as transformers' default, __en__ (or the config's
    src_lang) before it and </s> after."""
    import json

    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, models, processors
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    try:
        from transformers.convert_slow_tokenizer import generate_merges
    except ImportError:
        raise ConversionError("M2M-100's tokenizer converts with a newer transformers: pip install -U transformers")

    vocab = json.loads((folder / "vocab.json").read_text())
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((folder / "sentencepiece.bpe.model").read_bytes())
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise ConversionError(f"{folder / 'sentencepiece.bpe.model'} is not a BPE model, as M2M-100's is")
    pieces = {piece.piece: i for i, piece in enumerate(proto.pieces) if piece.type == piece.NORMAL}
    lacking = [piece for piece in pieces if piece not in vocab]
    if lacking:  # fairseq's dictionaries hold every piece; a piece without an id cannot be one of the BPE's
        print(f"note: {len(lacking)} piece(s) of the SentencePiece model are not in vocab.json ({', '.join(lacking[:3])}): "
              "they encode as smaller pieces, where M2M100Tokenizer gives <unk>", file=sys.stderr)
        pieces = {piece: rank for piece, rank in pieces.items() if piece in vocab}
    codes = FAIRSEQ_LANGUAGE_CODES[tokenizer_config.get("language_codes", "m2m100")]
    tokens = {f"__{code}__": len(vocab) + i for i, code in enumerate(codes)}  # after the dictionary, as transformers'
    tokenizer = Tokenizer(models.BPE(vocab | tokens, generate_merges(pieces, None), unk_token="<unk>", fuse_unk=True))
    spm_text(tokenizer, folder / "sentencepiece.bpe.model")
    specials = [token for token in ("<s>", "<pad>", "</s>", "<unk>") if token in vocab]
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials + list(tokens)])
    source = f"__{tokenizer_config.get('src_lang') or 'en'}__"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{source} $A </s>", special_tokens=[(source, tokens[source]), ("</s>", vocab["</s>"])])
    return tokenizer


# ---------------------------------------------------------------- languages

# A multilingual tokenizer's class -> its language codes' pattern, and where the source language's code goes:
# before the text (then the text, then EOS) or after the text's EOS; the target language is then the first token
# decoding outputs (forced_bos_token_id). Marian's multilingual models take only the target's code, before the text.
LANGUAGES = {"NllbTokenizer": (r"^[a-z]{3}_[A-Z][a-z]{3}$", "before"),
             "M2M100Tokenizer": (r"^__[a-z_]{2,8}__$", "before"),
             "MBart50Tokenizer": (r"^[a-z]{2}_[A-Z]{2}$", "before"),
             "MBartTokenizer": (r"^[a-z]{2}_[A-Z]{2}$", "after"),
             "MarianTokenizer": (r"^>>.+<<$", "target first")}  # opus-mt's >>fra<<: the target's, before the text


def languages(tokenizer_config: dict) -> dict | None:
    """How a tokenizer marks languages, by its class (tokenizer_config.json's): {"pattern", "source"} or None."""
    name = (tokenizer_config.get("tokenizer_class") or "").removesuffix("Fast")
    if name not in LANGUAGES:
        return None
    pattern, where = LANGUAGES[name]
    return {"pattern": pattern, "source": where}


# ---------------------------------------------------------------- the table


CONVOLUTION = re.compile(r"^stem\.conv\d\.weight$")


@dataclass(frozen=True)
class Family:
    name: str
    renames: tuple  # (pattern, replacement): a checkpoint's weight name -> ours
    arguments: Callable[[dict], dict]  # config -> model.ModelArgs' fields that differ from the config's own
    embeddings: tuple[str, ...]  # the names a checkpoint may store the shared embedding under
    tables: Callable = lambda config, args: {}  # config, ModelArgs -> weights computed, not read
    scaled_queries: bool = False  # scores times d_kv**-0.5: folded into the queries' projection
    convolutions: bool = False  # PyTorch's convolution weights (out, in, width), which MLX takes as (out, width, in)

    def rename(self, name: str) -> str | None:
        """Ours for a checkpoint's weight name; None for one the model does not take (a replacement of None: one it
        has under another name)."""
        for pattern, replacement in self.renames:
            if re.match(pattern, name):
                return None if replacement is None else re.sub(pattern, replacement, name)
        return None

    def transform(self, ours: str, array, args):
        """A checkpoint's weight as ours uses it."""
        if self.scaled_queries and re.search(r"(attention|self_attention|cross_attention)\.q\.(weight|bias)$", ours):
            return array * args.d_kv**-0.5
        if ours == "final_logits_bias":
            return array.reshape(-1)
        if self.convolutions and CONVOLUTION.search(ours):
            return array.transpose(0, 2, 1)
        return array

    def shape(self, ours: str, shape: list[int]) -> list[int]:
        """A checkpoint's weight's shape as ours has it (transform)."""
        if ours == "final_logits_bias":
            return [math.prod(shape)]
        if self.convolutions and CONVOLUTION.search(ours):
            return [shape[0], shape[2], shape[1]]
        return shape


T5_EMBEDDINGS = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
T5_FAMILY = Family("T5", T5_RENAMES, t5_arguments, T5_EMBEDDINGS)
UMT5_FAMILY = Family("umT5", UMT5_RENAMES, t5_arguments, T5_EMBEDDINGS)
BART_FAMILY = Family("BART", BART_RENAMES, bart_arguments,
                     ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                      "shared.weight"), bart_tables, scaled_queries=True)
WHISPER_FAMILY = Family("Whisper", WHISPER_RENAMES, whisper_arguments, ("model.decoder.embed_tokens.weight",),
                        whisper_tables, scaled_queries=True, convolutions=True)
FAMILIES = {"t5": T5_FAMILY, "mt5": T5_FAMILY, "umt5": UMT5_FAMILY} | {kind: BART_FAMILY for kind in BART_KINDS} | \
    {"whisper": WHISPER_FAMILY}


def family_of(config: dict) -> Family:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(f"a '{model_type}' model is not one this converts (it takes: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


# ---------------------------------------------------------------- each family's tokenizer


def write_tokenizer(source: Path, folder: Path, tokenizer_config: dict) -> dict | None:
    """Write the tokenizer.json that loading.py reads (with no transformers)
    into folder, as the checkpoint's tokenizer class makes it, unless the
    checkpoint brought one; the config's "tokenizer" entry when it is no
    vocabulary (ByT5's bytes), else None."""
    kind = tokenizer_config.get("tokenizer_class")
    if kind == "ByT5Tokenizer":
        return {"kind": "bytes", "extra_ids": tokenizer_config.get("extra_ids", 125)}
    path = folder / "tokenizer.json"
    if path.is_file():
        return None
    if (source / "source.spm").is_file():  # Marian's two SentencePiece models
        marian_tokenizer(source).save(str(path))
    elif kind == "M2M100Tokenizer":
        m2m100_tokenizer(source, tokenizer_config).save(str(path))
    else:
        write_tokenizer_json(source, path)
    return None


def write_tokenizer_json(source: Path, path: Path) -> None:
    """A tokenizer.json for a checkpoint that has only spiece.model (or
    another tokenizer's own files), through transformers (which converts
    SentencePiece models)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ConversionError(f"{source}'s tokenizer ({type(tokenizer).__name__}) has no fast form to write as "
                              "tokenizer.json: its models do not convert yet")
    tokenizer.backend_tokenizer.save(str(path))
