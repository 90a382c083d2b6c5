"""A finished request -> its OpenAI Batch output line. The worker and the local run both write these,
so one input gives the same lines either way (no wall-clock fields; ids derive from the request).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the shared job model imports no engine; these are only types
    from prefixgrove.engine.outputs import CompletionOutput, RequestOutput


def request_hash(index: int, custom_id: str) -> str:
    # NOTE: "surrogatepass": a custom_id is valid Unicode once validated, yet hashing must not be
    # what fails a request after all its tokens were generated.
    key = f"{index}:{custom_id}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=12).hexdigest()


def success_line(
    index: int,
    custom_id: str,
    endpoint: str,
    params: dict[str, Any],
    model: str,
    out: RequestOutput,
    tokenizer: Any,
) -> str:
    """`params` are the request's SamplingParams keyword arguments (for how many top logprobs)."""
    h = request_hash(index, custom_id)
    completion = out.outputs[0]
    prompt_tokens = len(out.prompt_token_ids)
    choice: dict[str, Any] = {"index": 0}
    if endpoint == "chat":
        choice["message"] = {"role": "assistant", "content": completion.text}
    choice.update(
        text=completion.text,
        token_ids=list(completion.token_ids),
        logprobs=_logprobs(completion, endpoint, tokenizer, int(params.get("logprobs") or 0)),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )
    body = {
        "id": f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{h}",
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(completion.token_ids),
            "total_tokens": prompt_tokens + len(completion.token_ids),
        },
    }
    line = {
        "id": f"batch_req_{h}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": h, "body": body},
        "error": None,
    }
    return json.dumps(line, ensure_ascii=False)


def _logprobs(
    completion: CompletionOutput, endpoint: str, tokenizer: Any, k: int
) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    tokens, chosen, tops = [], [], []
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=False):
        tokens.append(_token_text(token_id, entry, tokenizer))
        chosen.append(entry[token_id].logprob if token_id in entry else None)
        alternatives = sorted(
            ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k),
            key=lambda item: item[1].rank or 0,
        )
        tops.append([(_token_text(tid, entry, tokenizer), lp.logprob) for tid, lp in alternatives])
    if endpoint == "chat":
        content = [
            {
                "token": token,
                "logprob": logprob,
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top],
            }
            for token, logprob, top in zip(tokens, chosen, tops, strict=True)
        ]
        return {"content": content}
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": [dict(top) for top in tops],
        "text_offset": offsets,
    }


def _token_text(token_id: int, entry: dict[int, Any], tokenizer: Any) -> str:
    decoded = entry[token_id].decoded_token if token_id in entry else None
    if decoded is not None:
        return str(decoded)
    return str(tokenizer.decode([token_id], skip_special_tokens=False))
