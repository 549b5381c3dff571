"""Weight files, in and out, as convert.py handles them: a Hugging Face checkpoint's read a tensor at a time, so that
converting T5-11B on a 16 GB Mac holds about one tensor (safetensors files with plain file reads and no PyTorch,
pytorch_model.bin files memory-mapped with PyTorch, their read pages given back as they go); and an output folder
that appears whole or not at all (`atomic_folder`).
"""

import contextlib
import ctypes
import functools
import json
import math
import mmap
import os
import re
import shutil
import socket
import struct
import sys
from pathlib import Path

import cpu  # noqa: F401  (before mlx.core)
import mlx.core as mx
import numpy as np

from errors import ConversionError


def weight_files(folder: Path) -> tuple[str, list[Path]]:
    """('safetensors' | 'torch', files), preferring safetensors."""
    for kind, single, index in [
        ("safetensors", "model.safetensors", "model.safetensors.index.json"),
        ("torch", "pytorch_model.bin", "pytorch_model.bin.index.json"),
    ]:
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ConversionError(f"{folder / index} is corrupt ({e})")
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ConversionError(f"{folder} is missing weight shard {missing[0]} named in {index}")
            return kind, [folder / s for s in shards]
        if (folder / single).is_file():
            return kind, [folder / single]
    raise ConversionError(f"{folder} holds no weights (model.safetensors or pytorch_model.bin)")


class SafetensorsReader:
    """name -> shape and tensors, read with plain file reads (no torch).

    Not a memory map (safetensors' safe_open): every mapped page touched stays
    in the process's resident memory, so converting T5-11B would hold 45 GB.
    """

    NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}

    def __init__(self, files: list[Path]):
        self.entries = {}  # name -> (file, byte offset, safetensors dtype, shape)
        for file in files:
            size = file.stat().st_size
            try:
                with open(file, "rb") as f:
                    (header_size,) = struct.unpack("<Q", f.read(8))
                    if header_size > size - 8:
                        raise ValueError("header runs past the end of the file")
                    header = json.loads(f.read(header_size))
                header.pop("__metadata__", None)
                for name, info in header.items():
                    start, end = info["data_offsets"]
                    if info["dtype"] not in self.NUMPY_DTYPES:
                        raise ValueError(f"{name} has unsupported dtype {info['dtype']}")
                    itemsize = np.dtype(self.NUMPY_DTYPES[info["dtype"]]).itemsize
                    if not 0 <= start <= end or end - start != itemsize * math.prod(info["shape"]):
                        raise ValueError(f"{name}'s offsets do not match its shape")
                    if 8 + header_size + end > size:
                        raise ValueError(f"{name} runs past the end of the file")
                    self.entries[name] = (file, 8 + header_size + start, info["dtype"], info["shape"])
            except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ConversionError(f"{file} is truncated or corrupt ({e})")
            except OSError as e:
                raise ConversionError(f"cannot read {file}: {e.strerror or e}")

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> list[int]:
        return self.entries[name][3]

    def tensor(self, name: str) -> mx.array:
        file, offset, dtype, shape = self.entries[name]
        with open(file, "rb") as f:
            f.seek(offset)
            data = np.fromfile(f, dtype=self.NUMPY_DTYPES[dtype], count=math.prod(shape))
        array = mx.array(data.reshape(shape))
        return array.view(mx.bfloat16) if dtype == "BF16" else array


class TorchReader:
    """pytorch_model.bin files, loaded memory-mapped (needs PyTorch)."""

    def __init__(self, files: list[Path]):
        try:
            import torch
        except ImportError:
            raise ConversionError("this checkpoint is pytorch_model.bin: install PyTorch (pip install torch) to convert it")
        self.tensors, self.mapped = {}, set()
        for file in files:
            # Only the zip format (torch >= 1.6) maps; the legacy one is read whole.
            try:
                with file.open("rb") as f:
                    legacy = f.read(2) != b"PK"
            except OSError as e:
                raise ConversionError(f"cannot read {file}: {e.strerror or e}")
            if legacy:
                print(f"note: {file.name} is in PyTorch's legacy format: it is read whole into memory", file=sys.stderr)
            try:
                tensors = torch.load(str(file), map_location="cpu", mmap=not legacy, weights_only=True)
            except Exception as e:  # torch raises many types for a bad file
                raise ConversionError(f"{file} is truncated or corrupt ({str(e).splitlines()[0]})")
            self.tensors.update(tensors)
            if legacy:  # on the heap: never release these pages
                self.mapped.difference_update(tensors)
            else:
                self.mapped.update(tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def tensor(self, name: str) -> mx.array:
        import torch

        tensor = self.tensors[name]
        array = mx.array(tensor.to(torch.float32).numpy())  # a copy
        if name in self.mapped:
            release_pages(tensor.untyped_storage())
        return array


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def release_pages(storage) -> None:
    """Drop the mapped file pages a tensor was read from: read pages count
    as resident, so converting would otherwise grow memory to the file's size.
    Only for a storage in a read-only file mapping (a page touched again is
    read from the file); on heap memory this would zero live data."""
    if sys.platform != "linux" or storage.nbytes() == 0:
        return
    page = mmap.PAGESIZE
    start = storage.data_ptr() // page * page
    length = -(-(storage.data_ptr() + storage.nbytes() - start) // page) * page
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 4)  # MADV_DONTNEED


# ---------------------------------------------------------------- the output


OWNER = ".converting"  # "HOST PID" of the process writing a work folder


def remove_leftovers(folder_of_outputs: Path) -> None:
    """Work folders of conversions that were killed (SIGKILL, power loss),
    whatever their output: written on this host (see OWNER) by a process that
    is gone. A conversion stopped by Ctrl-C or SIGTERM removes its own."""
    pattern = re.compile(r"\..+\.partial-\d{1,9}")
    for folder in folder_of_outputs.iterdir():
        if not pattern.fullmatch(folder.name):
            continue
        try:
            host, pid = (folder / OWNER).read_text().split()
        except (OSError, ValueError):
            continue  # not ours to judge
        if host != socket.gethostname():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (PermissionError, OverflowError, ValueError):
            pass


@contextlib.contextmanager
def atomic_folder(out: Path, check_again):
    """A work folder beside `out` to write into, which becomes `out` (in
    place of an earlier one) only when the block ends well; on any error,
    Ctrl-C or SIGTERM, nothing half-written stays. `check_again()` runs just
    before the swap (the output may have appeared meanwhile). OSErrors come
    out as ConversionErrors that say which side failed."""
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out.parent)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        (partial / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
    except OSError as e:
        raise ConversionError(f"cannot write {out}: {e.strerror or e}")
    try:
        yield partial
        (partial / OWNER).unlink()
        check_again()
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(out)
    except OSError as e:  # a full disk, a read-only file system, an unreadable source file
        shutil.rmtree(partial, ignore_errors=True)
        where = e.filename and Path(e.filename)
        if where and partial in (where, *where.parents):
            raise ConversionError(f"cannot write {out}: {e.strerror or e}")
        raise ConversionError(f"cannot read {e.filename}: {e.strerror or e}" if where else f"conversion failed: {e}")
    except BaseException:  # Ctrl-C, SIGTERM, anything else
        shutil.rmtree(partial, ignore_errors=True)
        raise
