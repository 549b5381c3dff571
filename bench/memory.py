"""What fits where: `quantized` (float and quantized models: size, memory, speed and quality) and `sizes`
(public T5 shapes by format, and the smallest Mac that holds them)."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench import fixtures
from bench.fixtures import DEMO, PROMPT_IDS
from bench.harness import ROOT, decode, table


def resident(field: str) -> int:
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024


def decode_worker(folder: str, tokens: int) -> None:
    """In a fresh process: read every weight, decode `tokens` greedy tokens
    twice (the second timed), and report resident memory."""
    import mlx.core as mx

    from loading import Models, load_model
    from options import Settings

    model = load_model(folder)
    mx.eval(model.parameters())
    loaded = resident("VmRSS")
    forced = Settings(max_tokens=tokens, speculative=False, ignore_eos=True)
    decode(Models(model), [PROMPT_IDS], forced)
    _, (stats,), _ = decode(Models(model), [PROMPT_IDS], forced)
    print(json.dumps({"loaded": loaded, "peak": resident("VmHWM"), "tokens_per_second": stats.tokens_per_second}))


FORMATS = {"float32": [], "bfloat16": ["--dtype", "bfloat16"], "8-bit": ["-q", "--q-bits", "8"], "4-bit": ["-q", "--q-bits", "4"]}


def run_quantized(args) -> dict:
    """Size, memory and speed of float and quantized T5-large shapes, each
    run alternating in a fresh process; the demo target's fillings,
    acceptance and held-out loss at 8 and 4 bits."""
    import train
    from loading import Models, load_model, load_tokenizer
    from options import Settings

    hf_dir = fixtures.build_large(args.dir / "t5-large-random")
    folders, convert_peaks = {}, {}
    for name, options in FORMATS.items():  # float32: the folder `regular` uses
        folders[name] = args.dir / ("t5-large-random-mlx" if name == "float32" else f"t5-large-random-{name}")
        convert_peaks[name] = fixtures.convert_measuring_memory(hf_dir, folders[name], *options)
    runs = {name: [] for name in FORMATS}
    for _ in range(args.repeats):
        for name, folder in folders.items():
            done = subprocess.run([sys.executable, "-m", "bench", "--decode-worker", str(folder), "--tokens", str(args.tokens)],
                                  cwd=ROOT, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout))
    large = {name: {"disk": sum(f.stat().st_size for f in folders[name].glob("*.safetensors")),
                    "loaded": statistics.median(r["loaded"] for r in runs[name]),
                    "peak": statistics.median(r["peak"] for r in runs[name]),
                    "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs[name]),
                    "convert_peak": convert_peaks[name]} for name in FORMATS}
    # The demo target: trained weights, where quality can be seen.
    targets = {"float32": DEMO / "target"}
    for bits in (8, 4):
        targets[f"{bits}-bit"] = args.dir / f"demo-target-{bits}bit"
        fixtures.convert_measuring_memory(DEMO / "target", targets[f"{bits}-bit"], "-q", "--q-bits", str(bits))
    tokenizer = load_tokenizer(DEMO / "target")
    prompts = [tokenizer.encode(text) for text in fixtures.held_out_prompts()]
    draft = load_model(DEMO / "draft")
    fillings, demo = {}, {}
    for name, folder in targets.items():
        target = load_model(folder)
        fillings[name], _, _ = decode(Models(target), prompts, Settings(speculative=False), 1)
        _, stats, _ = decode(Models(target, draft), prompts, Settings(num_draft=3), 1)
        demo[name] = {"disk": sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")),
                      "same_fillings": sum(a == b for a, b in zip(fillings[name], fillings["float32"])),
                      "acceptance": sum(s.accepted for s in stats) / sum(s.drafted for s in stats)}
    for name, loss in zip(targets, train.evaluate(list(targets.values())).values()):
        demo[name]["loss"] = loss
    return {"tokens": args.tokens, "repeats": args.repeats, "large": large, "demo": demo, "prompts": len(prompts)}


def render_quantized(data: dict) -> str:
    large, demo = data["large"], data["demo"]
    rows = [["weights on disk"] + [f"{large[n]['disk'] / 1e9:.2f} GB" for n in large],
            ["resident after reading the weights"] + [f"{large[n]['loaded'] / 1e9:.2f} GB" for n in large],
            ["peak resident while decoding"] + [f"{large[n]['peak'] / 1e9:.2f} GB" for n in large],
            ["decoding speed"] + [f"{large[n]['tokens_per_second']:.2f} tokens/s" for n in large],
            ["conversion's peak resident"] + [f"{large[n]['convert_peak'] / 1e6:.0f} MB" for n in large]]
    quality = [["weights on disk"] + [f"{demo[n]['disk'] / 1e6:.1f} MB" for n in demo],
               ["fillings equal to float32's"] + [f"{demo[n]['same_fillings']} of {data['prompts']}" for n in demo],
               ["held-out loss (nats a token)"] + [f"{demo[n]['loss']:.4f}" for n in demo],
               ["acceptance of the float32 draft (num-draft 3, delta 0)"] + [f"{demo[n]['acceptance']:.2f}" for n in demo]]
    return (f"T5-large shapes (random weights), {data['tokens']} greedy tokens, medians of {data['repeats']} runs "
            "alternating in fresh processes; quantized in groups of 64, the rest float32\n\n"
            + table(["measure", *large], rows)
            + f"\n\nThe demo target (8.4 M parameters), quantized in groups of 64, on the {data['prompts']} held-out demo "
            "prompts, greedy\n\n" + table(["measure", *demo], quality))


# ---------------------------------------------------------------- sizes


# Shapes from the public configs on the Hugging Face hub (v1.0 T5: tied head, vocabulary 32128).
PUBLIC_T5 = {
    "t5-small": dict(d_model=512, d_ff=2048, num_heads=8, d_kv=64, num_layers=6),
    "t5-base": dict(d_model=768, d_ff=3072, num_heads=12, d_kv=64, num_layers=12),
    "t5-large": dict(d_model=1024, d_ff=4096, num_heads=16, d_kv=64, num_layers=24),
    "t5-3b": dict(d_model=1024, d_ff=16384, num_heads=32, d_kv=128, num_layers=24),
    "t5-11b": dict(d_model=1024, d_ff=65536, num_heads=128, d_kv=128, num_layers=24),
}
# The other families' pairs: (job, target, draft), each a public config's dimensions (Hugging Face's names).
_BART = dict(model_type="bart", d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
             encoder_ffn_dim=4096, vocab_size=50264, max_position_embeddings=1024, activation_function="gelu")
_NLLB = dict(model_type="m2m_100", encoder_attention_heads=16, vocab_size=256206, max_position_embeddings=1024,
             activation_function="relu", scale_embedding=True, pad_token_id=1)
_PEGASUS = dict(model_type="pegasus", d_model=1024, encoder_attention_heads=16, encoder_ffn_dim=4096, vocab_size=96103,
                max_position_embeddings=512, activation_function="relu", scale_embedding=True)
_FLAN = dict(model_type="t5", vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
_MADLAD = dict(model_type="t5", vocab_size=256000, feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=128,
               num_layers=32)
_WHISPER = dict(model_type="whisper", d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                encoder_ffn_dim=5120, vocab_size=51866, num_mel_bins=128, max_source_positions=1500,
                max_target_positions=448)
_WHISPER_MEDIUM = _WHISPER | dict(d_model=1024, encoder_layers=24, decoder_layers=24, encoder_attention_heads=16,
                                  encoder_ffn_dim=4096, vocab_size=51864, num_mel_bins=80)
# A distil-whisper draft keeps its target's encoder: loaded with it, it shares the target's (loading.same_encoder).
SHARED_ENCODER = "shared_encoder"
PUBLIC_PAIRS = [
    ("summarise news", ("facebook/bart-large-cnn", _BART), ("sshleifer/distilbart-cnn-12-6", _BART | {"decoder_layers": 6})),
    ("summarise in a sentence", ("google/pegasus-xsum", _PEGASUS | {"encoder_layers": 16, "decoder_layers": 16}),
     ("sshleifer/distill-pegasus-xsum-16-4", _PEGASUS | {"encoder_layers": 16, "decoder_layers": 4})),
    ("translate, 200 languages",
     ("facebook/nllb-200-3.3B", _NLLB | {"d_model": 2048, "encoder_layers": 24, "decoder_layers": 24, "encoder_ffn_dim": 8192}),
     ("facebook/nllb-200-distilled-600M", _NLLB | {"d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
                                                   "encoder_ffn_dim": 4096})),
    ("translate, 400 languages", ("google/madlad400-10b-mt", _MADLAD | {"d_model": 2048, "d_ff": 16384, "num_heads": 32}),
     ("google/madlad400-3b-mt", _MADLAD | {"d_model": 1024, "d_ff": 8192, "num_heads": 16})),
    ("follow instructions, fill in",
     ("google/flan-ul2", _FLAN | {"d_model": 4096, "d_ff": 16384, "num_layers": 32, "num_heads": 16, "d_kv": 256,
                                  "feed_forward_proj": "gated-silu"}),
     ("google/flan-t5-small", _FLAN | {"d_model": 512, "d_ff": 1024, "num_layers": 8, "num_heads": 6, "d_kv": 64})),
    ("transcribe, 99 languages", ("openai/whisper-large-v3", _WHISPER),
     ("distil-whisper/distil-large-v3", _WHISPER | {"decoder_layers": 2, SHARED_ENCODER: True})),
    ("transcribe English", ("openai/whisper-medium.en", _WHISPER_MEDIUM),
     ("distil-whisper/distil-medium.en", _WHISPER_MEDIUM | {"decoder_layers": 2, SHARED_ENCODER: True})),
]
RUNTIME_GB = 1.0  # an allowance for Python, MLX and caches (decoding itself adds ~0.1 GB: `quantized`)
# Metal's recommended working set (what a Mac's GPU may keep resident), GiB by memory size: two thirds of
# memory up to 32 GB (10.67 GiB reported on 16 GB Macs), 37.44 GiB reported on a 48 GB one, three quarters
# assumed for 64 GB. `sudo sysctl iogpu.wired_limit_mb` raises it.
MAC_WORKING_SET_GIB = {8: 5.33, 16: 10.67, 24: 16.0, 32: 21.33, 48: 37.44, 64: 48.0}
BITS = {"float32": None, "bfloat16": None, "8-bit": 8, "4-bit": 4}


def weight_bytes(shapes: dict, format: str, group_size: int = 64, only: tuple | None = None) -> int:
    """Bytes of a converted model's weights: projections and the embedding are
    quantized (with a bfloat16 scale and bias per group), the rest stays float.
    shapes: a v1.0 T5's, or a public config with its model_type; `only`: the
    weights whose names start so (("decoder.", "shared."): what a decode step reads)."""
    from convert import Quantization
    from mlx.utils import tree_flatten

    import families
    from model import EncoderDecoder, ModelArgs

    if "model_type" in shapes:  # a family's config, as convert.py reads it
        args = ModelArgs.from_dict(shapes | families.family_of(shapes).arguments(shapes))
    else:
        args = ModelArgs(vocab_size=32128, num_decoder_layers=shapes["num_layers"], **shapes)
    model = EncoderDecoder(args)  # lazy: only shapes are read
    bits, total = BITS[format], 0
    for name, array in tree_flatten(model.parameters()):
        if shapes.get(SHARED_ENCODER) and name.startswith(("encoder.", "stem.")) or only and not name.startswith(only):
            continue
        if bits and Quantization(bits, group_size).applies(name, array.shape):
            total += array.size * bits // 8 + 2 * 2 * array.size // group_size
        else:
            total += array.size * (4 if format == "float32" else 2)
    return total


def run_sizes(args) -> dict:
    """Weights by model and format, computed from the public shapes; each
    row's cache for a batch (keys and values a token a layer, both models)."""
    sizes = {name: {format: weight_bytes(shapes, format) for format in BITS} for name, shapes in PUBLIC_T5.items()}
    draft = PUBLIC_T5["t5-small"]
    cache = {name: sum(2 * s["num_heads"] * s["d_kv"] * s["num_layers"] * 2 for s in (shapes, draft))
             for name, shapes in PUBLIC_T5.items()}
    pairs = [{"job": job, "target": target, "draft": draft_name,
              "weights": {name: {format: weight_bytes(config, format) for format in ("bfloat16", "4-bit")}
                          for name, config in ((target, target_config), (draft_name, draft_config))},
              "cache_bytes_per_token": sum(cache_bytes(config) for config in (target_config, draft_config)),
              "layer_bytes_per_token": max(cache_bytes(config, one_layer=True) for config in (target_config, draft_config)),
              "vocabulary": target_config["vocab_size"]}
             for job, (target, target_config), (draft_name, draft_config) in PUBLIC_PAIRS]
    return {"weights": sizes, "cache_bytes_per_token": cache, "runtime_gb": RUNTIME_GB, "working_set_gib": MAC_WORKING_SET_GIB,
            "pairs": pairs}


def cache_bytes(config: dict, one_layer: bool = False) -> int:
    """A token's keys and values in every decoder layer (or one), in bfloat16 (a 4-bit model's activations too)."""
    import families
    from model import ModelArgs

    args = ModelArgs.from_dict(config | families.family_of(config).arguments(config))
    return (1 if one_layer else args.num_decoder_layers) * 2 * args.num_heads * args.d_kv * 2


# What the server's default cache budget (server.py --cache-memory) takes at once, for these pairs: requests of a
# 512-token prompt and 100 tokens of output, drafting 4 tokens a round.
BUDGET_PAIRS = (("t5-11b", "4-bit"), ("facebook/nllb-200-3.3B", "bfloat16"), ("facebook/nllb-200-3.3B", "4-bit"))
BUDGET_MACS = (16, 32, 64)


def budget_table(data: dict) -> str:
    from serving.budget import RESERVED, held_bytes, text_footprint

    footprint = text_footprint(512, 100, verified=5)
    working_set = {int(memory): gib for memory, gib in data["working_set_gib"].items()}  # (JSON's keys are text)
    rows = []
    for target, format in BUDGET_PAIRS:
        if target in data["weights"]:  # a T5 with a t5-small draft
            weights = data["weights"][target][format] + data["weights"]["t5-small"][format]
            per_position, vocabulary, draft = data["cache_bytes_per_token"][target], 32128, "t5-small"
            layer = max(2 * shapes["num_heads"] * shapes["d_kv"] * 2 for shapes in (PUBLIC_T5[target], PUBLIC_T5[draft]))
        else:
            pair = next(pair for pair in data.get("pairs", []) if pair["target"] == target)
            if "layer_bytes_per_token" not in pair:
                return ""
            weights = sum(w[format] for w in pair["weights"].values())
            per_position, vocabulary, draft = pair["cache_bytes_per_token"], pair["vocabulary"], pair["draft"]
            layer = pair["layer_bytes_per_token"]
        cells = []
        for mac in BUDGET_MACS:
            budget = working_set[mac] * 2**30 * (1 - RESERVED) - weights
            fits = 0
            while budget > 0 and held_bytes([footprint] * (fits + 1), per_position, vocabulary, layer_position=layer) <= budget:
                fits += 1
            cells.append(f"{max(budget, 0) / 2**30:.1f} GiB: {fits} rows" if budget > 0 else "no room")
        alone = held_bytes([footprint], per_position, vocabulary, layer_position=layer)
        rows.append([f"`{target}` + `{draft}`, {format}", f"{alone / 2**30:.2f} GiB", *cells])
    return table(["pair", "a request holds at most", *[f"{mac} GB Mac" for mac in BUDGET_MACS]], rows)


def smallest_mac(data: dict, name: str, format: str) -> str:
    """The smallest Mac whose working set holds the model, a t5-small draft of the same format and the runtime."""
    need = data["weights"][name][format] + data["weights"]["t5-small"][format] + data["runtime_gb"] * 1e9
    return next((f"{memory}" for memory, limit in data["working_set_gib"].items() if need <= limit * 2**30), "> 64")


def sizes_table(data: dict) -> str:
    """Weights by model and format, each with the smallest Mac that runs it (the README's table)."""
    weights = data["weights"]
    rows = [[name, f"{weights[name]['float32'] // 4 / 1e6:,.0f} M"]
            + [f"{weights[name][f] / 1e9:.2f} GB, {smallest_mac(data, name, f)} GB Mac" for f in BITS] for name in weights]
    return table(["model", "parameters", *BITS], rows)


def pairs_table(data: dict) -> str:
    """The other families' pairs: each model's weights, and the smallest Mac that runs the pair (the README's table)."""
    rows = []
    for pair in data.get("pairs", []):
        weights = pair["weights"]
        cells = []
        for format in ("bfloat16", "4-bit"):
            need = sum(w[format] for w in weights.values()) + data["runtime_gb"] * 1e9
            mac = next((f"{m} GB" for m, limit in data["working_set_gib"].items() if need <= limit * 2**30), "> 64 GB")
            target, draft = weights[pair["target"]][format], weights[pair["draft"]][format]
            cells.append(f"{target / 1e9:.2f} + {draft / 1e9:.2f} GB, {mac} Mac")
        rows.append([pair["job"], f"`{pair['target']}`", f"`{pair['draft']}`", *cells])
    return table(["job", "target", "draft", "bfloat16 (target + draft)", "4-bit"], rows)


def render_sizes(data: dict) -> str:
    cache = [[name, f"{b / 2**10:,.0f} KiB", f"{b * 612 / 2**20:,.0f} MiB"] for name, b in data["cache_bytes_per_token"].items()]
    return ("Weights by format, and the smallest Mac whose Metal working set holds the model with a t5-small draft "
            f"of the same format and {data['runtime_gb']:.0f} GB for the runtime\n\n" + sizes_table(data)
            + "\n\nCache a row of a batch needs, bfloat16, with a t5-small draft: a token of prompt or output, and a "
            "512-token prompt with 100 tokens of output\n\n" + table(["target", "a token", "512 + 100 tokens"], cache)
            + "\n\nThe other families' pairs, from their public configs, with the smallest Mac that holds both and the "
            "runtime (a distil-whisper draft's weights are its decoder's: it shares its target's encoder)\n\n"
            + pairs_table(data) + ("\n\nThe server's default cache budget (its Metal working set less the weights and "
            "10%) and the requests of a 512-token prompt and 100 tokens of output, drafting 4 a round, it takes at once "
            "by their caches (each one's at most, a layer's copy, its logits: serving/budget.py); the encoder's "
            "working memory for the rows being encoded, which start-up measures, comes off it\n\n" + budget_table(data)
            if budget_table(data) else ""))
