"""MLX's compiled CPU kernels: where they are kept, how many there are, and how long they took to compile.

On Linux, MLX compiles each fused kernel of a compiled graph (model.py
compiles each decode step) with the system's C++ compiler the first time a
process on the machine needs it, and keeps it. A run that first needs one
waits for the compiler: the engine keeps that wait apart from encoding and
decoding (`compiling_seconds`, options.Stats), and the command line says it.
"""

import functools
import sys
import tempfile
from pathlib import Path

import cpu
import mlx.core as mx


def kernel_folder() -> Path | None:
    """Where MLX keeps the CPU kernels it compiles. On Linux, MLX builds the
    fused kernels of compiled graphs (model.py compiles each decode step)
    with the system's C++ compiler, each once per MLX version, into a folder
    under the temporary directory; a run that first needs one waits for the
    compiler (about 20 s for the demo's kernels on 2 cores; a first 4-bit,
    bfloat16 or penalised run needs more). None on macOS and GPUs, where
    kernels compile in moments."""
    if sys.platform == "darwin" or not cpu.mlx_computes_on_cpu():  # whichever path: where MLX computes
        return None
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def uncompiled_kernels() -> Path | None:
    """kernel_folder(), when no kernel is there yet: this machine's first run."""
    folder = kernel_folder()
    return None if folder is None or (folder.is_dir() and any(folder.glob("lib*.so"))) else folder


def compiled_kernels() -> int:
    """How many CPU kernels MLX has compiled on this machine so far (0 where it compiles none)."""
    return kernels().read()[1]


def compiling_seconds() -> float:
    """The seconds MLX has spent compiling the CPU kernels in its folder, all
    told: a clock that moves only while kernels compile, so that the engine
    keeps that time apart from encoding and decoding (options.Stats). A
    kernel compiles once a machine, so on a later run it stands still; 0
    where MLX compiles none. (Another process's compiles, at the same time,
    count too.)"""
    return kernels().read()[0]


class Kernels:
    """The CPU kernels MLX has compiled into a folder: the seconds their
    compiles took, each from its source (NAME.cpp) written to its library
    (libNAME.so) written, and how many; read again only when the folder has
    changed (a stat a call)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.last = (None, 0.0, 0)  # (the folder's modification time when read, seconds, kernels)

    def read(self) -> tuple[float, int]:
        if self.folder is None:
            return 0.0, 0
        try:
            stamp = self.folder.stat().st_mtime_ns
        except OSError:  # none compiled yet
            return 0.0, 0
        last = self.last  # one read: the server's engine thread reads it too
        if stamp != last[0]:
            seconds, count = 0.0, 0
            for library in self.folder.glob("lib*.so"):
                try:
                    source = library.with_name(library.name[3:-3] + ".cpp")
                    seconds += max(library.stat().st_mtime - source.stat().st_mtime, 0)
                except OSError:  # its source removed
                    pass
                count += 1
            last = self.last = (stamp, seconds, count)
        return last[1], last[2]


@functools.cache  # on first use, as cpu.in_use(): the folder of the device MLX computes on then
def kernels() -> Kernels:
    return Kernels(kernel_folder())
