"""OpenAI's and vLLM's response shapes, from what a request got: an error and usage for every endpoint; for each
endpoint its own renderer (`Shapes`): the completions endpoint answers with `text_completion` objects, the chat
endpoint with `chat.completion` (and `chat.completion.chunk`) ones, each carrying our `speculative` statistics
beside OpenAI's fields; /tokenize, /detokenize and /v1/models their own."""

from options import Stats


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative_stats(stats: Stats) -> dict:
    """What drafting did for a request (its choices' statistics summed)."""
    return {"drafted": stats.drafted, "accepted": stats.accepted, "acceptance_rate": round(stats.acceptance_rate, 4),
            "drafts_per_round": round(stats.drafts_per_round, 3), "target_calls": stats.target_calls,
            "tokens_per_second": round(stats.tokens_per_second, 2), "encoding_seconds": round(stats.encoding_seconds, 4)}


# A token's logprobs as shown: its text, its log-probability, and the most likely tokens' (text, log-probability).
Shown = tuple[str, float, list[tuple[str, float]]]


class Shapes:
    """How one endpoint's answers look: a whole one, its streamed chunks, its
    logprobs. Each endpoint has its own (`COMPLETIONS`, `CHAT`); what they
    share is here."""

    object: str  # a whole answer's "object"
    chunk_object: str  # a streamed chunk's
    id_prefix: str

    def choice(self, index: int, text: str, finish: str | None, given: dict | None) -> dict:
        raise NotImplementedError

    def piece(self, index: int, text: str | None, finish: str | None, given: dict | None) -> dict:
        raise NotImplementedError

    def opening(self, index: int) -> dict | None:
        """A choice's first chunk, before its text, if the endpoint sends one."""
        return None

    def logprobs(self, tokens: list[Shown], offsets: list[int]) -> dict:
        raise NotImplementedError

    def completion(self, request_id: str, created: int, model: str, choices: list[tuple[str, str, dict | None]],
                   used: dict, stats: Stats) -> dict:
        """A whole answer: each choice's (text, finish reason, logprobs or None), in order."""
        listed = [self.choice(i, text, finish, given) for i, (text, finish, given) in enumerate(choices)]
        return {"id": request_id, "object": self.object, "created": created, "model": model, "choices": listed,
                "usage": used, "speculative": speculative_stats(stats)}

    def chunk(self, request_id: str, created: int, model: str, choice: dict, stats: Stats | None = None,
              with_usage: bool = False) -> dict:
        """A streamed chunk of one choice (`piece` or `opening`'s), with the
        last its statistics. When the usage chunk will follow (`with_usage`),
        "usage" is null here, as OpenAI sends it."""
        data = {"id": request_id, "object": self.chunk_object, "created": created, "model": model, "choices": [choice]}
        if with_usage:
            data["usage"] = None
        if stats is not None:
            data["speculative"] = speculative_stats(stats)
        return data

    def usage_chunk(self, request_id: str, created: int, model: str, used: dict) -> dict:
        """The chunk after the last choice's, when stream_options.include_usage asks for it."""
        return {"id": request_id, "object": self.chunk_object, "created": created, "model": model, "choices": [],
                "usage": used}


class CompletionShapes(Shapes):
    """/v1/completions: `text_completion` objects, legacy logprobs."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index, text, finish, given):
        return {"index": index, "finish_reason": finish, "logprobs": given, "text": text}

    def piece(self, index, text, finish, given):
        return {"index": index, "text": text or "", "logprobs": given, "finish_reason": finish}

    def logprobs(self, tokens, offsets):
        """Parallel lists, whose top_logprobs also hold the chosen token, as OpenAI's do; offsets: where each token's
        text begins."""
        return {"tokens": [text for text, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
                "top_logprobs": [dict(top) | {text: lp} for text, lp, top in tokens], "text_offset": offsets}


class ChatShapes(Shapes):
    """/v1/chat/completions: `chat.completion` objects, the assistant's message, token objects for logprobs."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index, text, finish, given):
        return {"index": index, "finish_reason": finish, "logprobs": given,
                "message": {"role": "assistant", "content": text}}

    def piece(self, index, text, finish, given):
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": given, "finish_reason": finish}

    def opening(self, index):
        return {"index": index, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}

    def logprobs(self, tokens, offsets):
        def entry(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [entry(text, lp) | {"top_logprobs": [entry(t, v) for t, v in top]} for text, lp, top in tokens],
                "refusal": None}


COMPLETIONS, CHAT = CompletionShapes(), ChatShapes()


def tokenized(ids: list[int], max_model_len: int, strings: list[str] | None) -> dict:
    """/tokenize's answer, as vLLM gives it."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strings}


def detokenized(text: str) -> dict:
    """/detokenize's."""
    return {"prompt": text}


def model_list(names: list[str]) -> dict:
    """/v1/models': the names clients may give."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "local"} for name in names]}
