"""A finished request -> its OpenAI Batch output line; a refused one -> its error line. The worker
and the local run both write these, so one input gives the same lines either way: no wall-clock
fields, and ids derive from the job (`<r>`, its run tag: a job's ids are its own), the request's
position and custom_id (`<h>`) and, in a success line, from the request as it ran (`<f>`: its
fingerprint). Given the same run id, `prefixgrove run` writes the bytes the services write.

A success line is what OpenAI's Batch API writes, its body a ChatCompletion or a Completion that
the `openai` package's types accept strictly (tests/jobs/test_output_lines.py checks them):

  {"id": "batch_req_<r><h><f>", "custom_id": ..., "error": null,
   "response": {"status_code": 200, "request_id": "<r><h>", "body": <chat.completion | text_completion>}}

A resumed `prefixgrove run` keeps a success line only while `<f>` is the fingerprint of the line's
request now, so an answer never outlives a change to the request it answers.

An error line: {"id": "batch_req_<r><h>", "custom_id": ..., "response": null,
"error": {"code": ..., "message": ...}}. A request the engine finished as an error (finish_reason
"error": its structured-output constraint could not be enforced) gets one too, never a success line:
`failed_output` gives its code and message.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixgrove.jobs.tool_calls import assistant_reply

if TYPE_CHECKING:  # the shared job model imports no engine; these are only types
    from prefixgrove.engine.sampling.outputs import CompletionOutput, RequestOutput

# NOTE: `created` is part of the byte-equal contract between the services and `prefixgrove run`,
# so it cannot be a clock reading; the job record keeps when the job was created.
CREATED = 0


RUN_TAG_CHARS = 12


def run_tag(run_id: str) -> str:
    """The part of every id of a job's lines that makes them that job's own, so that no two jobs
    share an id (OpenAI's ids are unique too): 12 hex digits of the job's id (the planner's job
    id; a local run's --run-id, or one it makes up)."""
    return hashlib.blake2b(run_id.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()


def request_hash(index: int, custom_id: str | None) -> str:
    # NOTE: "surrogatepass": a custom_id is valid Unicode once validated, yet hashing must not be
    # what fails a request after all its tokens were generated.
    key = f"{index}:{custom_id or ''}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=12).hexdigest()


def request_fingerprint(
    endpoint: str, params: dict[str, Any], prompt_token_ids: Sequence[int], model: str | None
) -> str:
    """What the engine was asked, canonical: the endpoint, the prompt's token ids (after any
    truncation), the sampling settings and the body's model. Two bodies that differ only in how
    they are written (key order, spacing, 1 or 1.0) ask the same; any change that can change the
    answer changes it, a JSON schema's property order too (the output follows it)."""
    head = json.dumps([endpoint, model, params], sort_keys=True, separators=(",", ":"))
    digest = hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=8)
    schema = (params.get("structured_outputs") or {}).get("json")
    if isinstance(schema, dict):
        ordered = json.dumps(schema, separators=(",", ":"))
        digest.update(ordered.encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(prompt_token_ids, dtype="<i8").tobytes())
    return digest.hexdigest()


def served_model_name(model: str) -> str:
    """The name a response reports: a local checkout is named by its folder, never its path."""
    if model.startswith(("/", ".", "~")):
        return model.rstrip("/").rsplit("/", 1)[-1]
    return model


def error_line(index: int, custom_id: str | None, code: str, message: str, tag: str) -> str:
    """`tag`: the job's run_tag."""
    line = {
        "id": f"batch_req_{tag}{request_hash(index, custom_id)}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return json.dumps(line, ensure_ascii=False)


def failed_output(out: RequestOutput) -> tuple[str, str] | None:
    """(code, message) of a request the engine ended as an error, else None: a sample whose
    constraint failed makes the whole request `constraint_failed` (its output breaks the
    constraint, or stops short of it, so it is no answer)."""
    for completion in out.outputs:
        if completion.finish_reason == "error":
            which = f"sample {completion.index}: " if len(out.outputs) > 1 else ""
            return "constraint_failed", which + (completion.error or "the request failed")
    return None


def success_line(
    index: int,
    custom_id: str,
    endpoint: str,
    params: dict[str, Any],
    model: str,
    out: RequestOutput,
    tokenizer: Any,
    *,
    requested_model: str | None,
    tag: str,
) -> str:
    """`params` are the request's SamplingParams keyword arguments (for how many top logprobs).
    The body names the request's `model` when it gave one, else the served `model` (named as
    `served_model_name` says). `tag`: the job's run_tag."""
    h = tag + request_hash(index, custom_id)
    fingerprint = request_fingerprint(endpoint, params, out.prompt_token_ids, requested_model)
    name = requested_model or served_model_name(model)
    if endpoint == "embeddings":
        return _line(h, fingerprint, custom_id, _embeddings(h, name, out, params))
    top = int(params.get("logprobs") or 0)
    choices = [_choice(c, endpoint, tokenizer, top, params, h) for c in out.outputs]
    _echo(choices, params, out, tokenizer)
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body: dict[str, Any] = {
        "id": f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{h}",
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "created": CREATED,
        "model": name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # the group's shared prefix only: prefix-cache hits depend on what else the engine
            # ran, and a job's lines are the same bytes on every path
            "prompt_tokens_details": {"cached_tokens": out.num_shared_prefix_tokens},
        },
    }
    if params.get("prompt_logprobs") is not None:  # vLLM's field: the body's for chat
        scored = _prompt_logprobs(out, tokenizer)
        for choice in [body] if endpoint == "chat" else choices:
            choice["prompt_logprobs"] = scored
    return _line(h, fingerprint, custom_id, body)


def _line(h: str, fingerprint: str, custom_id: str, body: dict[str, Any]) -> str:
    line = {
        "id": f"batch_req_{h}{fingerprint}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": h, "body": body},
        "error": None,
    }
    return json.dumps(line, ensure_ascii=False)


def _embeddings(h: str, model: str, out: RequestOutput, params: dict[str, Any]) -> dict[str, Any]:
    """A CreateEmbeddingResponse (with vLLM's id and created): one embedding per input."""
    as_text = params.get("encoding_format") == "base64"
    data = [
        {
            "object": "embedding",
            "index": c.index,
            "embedding": _base64(c.embedding or []) if as_text else c.embedding,
        }
        for c in out.outputs
    ]
    tokens = len(out.prompt_token_ids)
    return {"id": f"embd-{h}", "object": "list", "created": CREATED, "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _base64(embedding: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values' little-endian bytes."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


def _choice(
    completion: CompletionOutput,
    endpoint: str,
    tokenizer: Any,
    k: int,
    params: dict[str, Any],
    h: str,
) -> dict[str, Any]:
    """One sample. Beside OpenAI's fields it keeps `token_ids` and `stop_reason` (the stop string
    or token that ended it), which OpenAI's types allow as extra fields; a chat reply's thinking
    and tool calls are parsed out of it (tool_calls.py)."""
    if completion.finish_reason not in ("stop", "length"):
        raise ValueError(
            f"sample {completion.index} ended with finish_reason {completion.finish_reason!r}; "
            "a finished request's samples end with 'stop' or 'length'"
        )
    choice: dict[str, Any] = {"index": completion.index}
    finish = completion.finish_reason
    if endpoint == "chat":
        choice["message"], finish = assistant_reply(
            completion.text, completion.token_ids, finish, params, tokenizer,
            f"{h}:{completion.index}",
        )  # fmt: skip
    else:
        choice["text"] = completion.text
    choice.update(
        token_ids=list(completion.token_ids),
        logprobs=_logprobs(completion, endpoint, tokenizer, k),
        finish_reason=finish,
        stop_reason=completion.stop_reason,
    )
    return choice


def _echo(
    choices: list[dict[str, Any]], params: dict[str, Any], out: RequestOutput, tokenizer: Any
) -> None:
    """vLLM's echo: a completion's text after its prompt's (the prompt's token ids decoded, so
    that every path writes the same text), a chat reply after the assistant message it follows."""
    if params.get("echo"):
        skip = params.get("skip_special_tokens", True)
        counts = params.get("prompt_parts") or [len(out.prompt_token_ids)]  # each prompt's
        ends = [sum(counts[: k + 1]) for k in range(len(counts))]
        prompts = [
            tokenizer.decode(out.prompt_token_ids[end - count : end], skip_special_tokens=skip)
            for count, end in zip(counts, ends, strict=True)
        ]
        n = int(params.get("n") or 1)  # a prompt's choices are n in turn (prompt_parts.py)
        for choice in choices:
            choice["text"] = prompts[choice["index"] // n] + choice["text"]
    prefix = params.get("echo_prefix")
    if prefix:
        for choice in choices:
            choice["message"]["content"] = prefix + (choice["message"]["content"] or "")


def _prompt_logprobs(out: RequestOutput, tokenizer: Any) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token and the top ones."""
    scored: list[dict[str, Any] | None] = []
    for entry in out.prompt_logprobs or []:
        if entry is None:
            scored.append(None)
            continue
        scored.append({
            str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                       "decoded_token": _token_text(tid, entry, tokenizer)}
            for tid, lp in entry.items()
        })  # fmt: skip
    return scored


def _logprobs(
    completion: CompletionOutput, endpoint: str, tokenizer: Any, k: int
) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    tokens, chosen, tops = [], [], []
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=False):
        tokens.append(_token_text(token_id, entry, tokenizer))
        chosen.append(entry[token_id].logprob)
        alternatives = sorted(
            ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= k),
            key=lambda item: item[1].rank or 0,
        )
        tops.append([(_token_text(tid, entry, tokenizer), lp.logprob) for tid, lp in alternatives])
    if endpoint == "chat":
        return {"content": [_chat_token(*each) for each in zip(tokens, chosen, tops, strict=True)]}
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


def _chat_token(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": _utf8(token),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in top],
    }


def _utf8(token: str) -> list[int]:
    # "surrogatepass": a decoded token is the tokenizer's text, which json.dumps writes either way.
    return list(token.encode("utf-8", "surrogatepass"))


def _token_text(token_id: int, entry: dict[int, Any], tokenizer: Any) -> str:
    decoded = entry[token_id].decoded_token if token_id in entry else None
    if decoded is not None:
        return str(decoded)
    return str(tokenizer.decode([token_id], skip_special_tokens=False))
