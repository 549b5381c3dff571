"""OpenAI's response shapes, as plain functions of what a request got: a whole
completion, a streamed chunk, usage, an error. The completions endpoint
answers with `text_completion` objects, the chat endpoint with
`chat.completion` (and `chat.completion.chunk`) ones; each answer carries our
`speculative` statistics beside OpenAI's fields."""

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


def object_name(chat: bool, chunk: bool = False) -> str:
    if not chat:
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


# A token's logprobs as shown: its text, its log-probability, and the most likely tokens' (text, log-probability).
Shown = tuple[str, float, list[tuple[str, float]]]


def logprobs(chat: bool, tokens: list[Shown], offsets: list[int]) -> dict:
    """A choice's `logprobs`: chat's list of token objects, or the legacy
    completion's parallel lists (whose top_logprobs also hold the chosen
    token, as OpenAI's do). offsets: where each token's text begins."""
    if chat:
        def entry(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [entry(text, lp) | {"top_logprobs": [entry(t, v) for t, v in top]} for text, lp, top in tokens],
                "refusal": None}
    return {"tokens": [text for text, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [dict(top) | {text: lp} for text, lp, top in tokens], "text_offset": offsets}


def completion(request_id: str, created: int, model: str, chat: bool, choices: list[tuple[str, str, dict | None]],
               used: dict, stats: Stats) -> dict:
    """A whole answer: each choice's (text, finish reason, logprobs or None), in order."""
    listed = [{"index": i, "finish_reason": finish, "logprobs": given,
               **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
              for i, (text, finish, given) in enumerate(choices)]
    return {"id": request_id, "object": object_name(chat), "created": created, "model": model, "choices": listed,
            "usage": used, "speculative": speculative_stats(stats)}


def chunk(request_id: str, created: int, model: str, chat: bool, index: int, text: str | None,
          finish: str | None, first: bool = False, stats: Stats | None = None, with_usage: bool = False,
          given: dict | None = None) -> dict:
    """A streamed piece of choice `index`: its new text and its tokens'
    logprobs, if asked (a chat's first chunk names the role), and with the
    last, its finish reason and statistics.
    When the usage chunk will follow (`with_usage`), "usage" is null here, as OpenAI sends it."""
    if chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": given, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": given, "finish_reason": finish}
    data = {"id": request_id, "object": object_name(chat, chunk=True), "created": created, "model": model,
            "choices": [choice]}
    if with_usage:
        data["usage"] = None
    if stats is not None:
        data["speculative"] = speculative_stats(stats)
    return data


def usage_chunk(request_id: str, created: int, model: str, chat: bool, used: dict) -> dict:
    """The chunk after the last choice's, when stream_options.include_usage asks for it."""
    return {"id": request_id, "object": object_name(chat, chunk=True), "created": created, "model": model,
            "choices": [], "usage": used}
