"""Every error a caller can fix, in one place that every layer imports.

Each is a `T5Error`, printed as one line by the command line and the server:

    T5Error
    ├── OptionError   a generation option out of its range (also a ValueError)
    ├── LoadError     a model that cannot be loaded: not converted, damaged, not a draft for its target
    │   └── ModelNotFound   no converted model by that name (it says which role: target or draft)
    ├── ConversionError   a checkpoint convert.py cannot convert, or cannot find
    ├── UsageError    command-line input that cannot run (main.py)
    ├── StageError    a pipeline stage that failed or lost a peer (pipeline.py): it names the rank
    └── SweepError    a sweep that cannot run or be plotted (sweep.py)
"""


class T5Error(Exception):
    """A problem the caller can fix: a model that cannot be used, an option out of range."""


class OptionError(T5Error, ValueError):
    """A generation option out of its range; `param`, the option, where one is to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class LoadError(T5Error):
    """A model that cannot be loaded: not converted, damaged, or not a draft for its target."""


class ModelNotFound(LoadError):
    def __init__(self, message: str, role: str):
        super().__init__(message)
        self.role = role  # "target" or "draft"


class ConversionError(T5Error):
    """A checkpoint convert.py cannot find or convert."""


class StageError(T5Error):
    """A pipeline stage that failed, or lost a peer; the message names the rank."""


class UsageError(T5Error):
    """Bad input from the command line; printed as one line."""


class SweepError(T5Error):
    """A sweep that cannot run or be plotted; printed as one line."""
