"""A multilingual family's language codes, and where each goes: around the prompt's text, or in the decoder's opening.

One object per family convention, made from what convert.py recorded
(`families.LANGUAGES`: the codes' pattern, and where the source's goes):

- `SourceBefore` (NLLB, M2M-100, mBART-50): the source's code, the text,
  the end of text; the target's code is the first output token, forced
  (transformers' forced_bos_token_id), and stays in the output.
- `SourceAfter` (mBART cc25 and en-ro): the text, the end of text, the
  source's code; the target's code starts the decoder.
- `TargetFirst` (Marian's multilingual opus-mt): the target's code before
  the text (`>>fra<<`), no source code.

`plans.resolve` asks the loaded target's object for the prompt's marks and
the decoder's opening; nothing else branches on the family.
"""

import re
from dataclasses import dataclass

from errors import OptionError
from options import Opening


@dataclass(frozen=True)
class Languages:
    """A multilingual model's language codes (code -> token id)."""

    codes: dict
    source = ""  # where the source's code goes, as convert.py records it

    @classmethod
    def of(cls, config: dict, tokenizer) -> "Languages | None":
        """The converted config's languages, their codes read from the tokenizer; None for a model that marks none."""
        marked = config.get("languages")
        if not marked:
            return None
        pattern = re.compile(marked["pattern"])
        # Codes are added tokens (a piece of text of the same shape is not one), where the tokenizer says which.
        tokens = tokenizer.added_tokens() if hasattr(tokenizer, "added_tokens") else tokenizer.get_vocab()
        codes = {token: index for token, index in tokens.items() if pattern.match(token)}
        kind = next(kind for kind in (SourceBefore, SourceAfter, TargetFirst) if kind.source == marked["source"])
        return kind(codes) if codes else None

    def code(self, name: str, which: str) -> int:
        """A code's token id (Marian's fra for >>fra<< too, M2M-100's en for __en__); OptionError naming the codes
        there are."""
        name = next((code for code in (name, f">>{name}<<", f"__{name}__") if code in self.codes), name)
        if name not in self.codes:
            raise OptionError(f"unknown {which} language {name!r} (this model's: {', '.join(sorted(self.codes))})")
        return self.codes[name]

    def marks(self, src_lang: str | None, tgt_lang: str | None, eos: int) -> tuple[tuple, tuple] | None:
        """The ids around a prompt's text, (before, after), in place of the
        tokenizer's own; None: the tokenizer's own. OptionError for a
        language this model does not take."""
        raise NotImplementedError

    def opening(self, tgt_lang: str | None, model: Opening) -> Opening:
        """The decoder's opening for this target language, from the model's own."""
        return model


class SourceBefore(Languages):
    source = "before"

    def marks(self, src_lang, tgt_lang, eos):
        if tgt_lang is not None:
            self.code(tgt_lang, "target")
        return None if src_lang is None else ((self.code(src_lang, "source"),), (eos,))

    def opening(self, tgt_lang, model):
        return model if tgt_lang is None else Opening(model.start, self.code(tgt_lang, "target"))


class SourceAfter(Languages):
    source = "after"

    def marks(self, src_lang, tgt_lang, eos):
        if tgt_lang is not None:
            self.code(tgt_lang, "target")
        return None if src_lang is None else ((), (eos, self.code(src_lang, "source")))

    def opening(self, tgt_lang, model):
        return model if tgt_lang is None else Opening((self.code(tgt_lang, "target"),), model.forced)


class TargetFirst(Languages):
    source = "target first"

    def marks(self, src_lang, tgt_lang, eos):
        if src_lang is not None:
            raise OptionError("this model marks only the target language, in the prompt: it takes tgt-lang, not src-lang")
        return None if tgt_lang is None else ((self.code(tgt_lang, "target"),), (eos,))
