"""Prompt -> token ids with the model's own tokenizer (text, token ids or a chat), plus the checks that
need token ids: the vocabulary and the context length. Loads no weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np

from prefixgrove.jobs.prompt_parts import PARTS
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest
from prefixgrove.jobs.tool_calls import thinks, tool_format
from prefixgrove.jobs.vllm_fields import ChatOptions


class PromptTokenizer:
    """Tokenizes validated requests of one model, in batches."""

    def __init__(self, model: str, max_model_len: int | None = None) -> None:
        from prefixgrove.catalog.context import context_limit
        from prefixgrove.catalog.presets import load_hf_config, load_tokenizer

        config = load_hf_config(model)
        self.model = model
        self.tokenizer: Any = load_tokenizer(model)
        self.vocab_size: int = int(config.vocab_size)
        self.max_model_len: int = context_limit(config, max_model_len)

    def encode(self, requests: Sequence[BatchRequest]) -> list[np.ndarray | RequestError]:
        """Token ids (int32) for each request, or the error that stops it, in the same order."""
        texts = [r.prompt_text if r.prompt_text is not None else self._chat(r) for r in requests]
        to_encode = [i for i, t in enumerate(texts) if isinstance(t, str)]
        encoded = self._encode_texts([str(texts[i]) for i in to_encode], requests, to_encode)
        out: list[np.ndarray | RequestError] = []
        for request, text in zip(requests, texts, strict=True):
            if isinstance(text, RequestError):
                out.append(text)
                continue
            if request.prompt_parts is not None:
                out.append(self._parts(request))
                continue
            given = request.prompt_token_ids
            ids = encoded[request.index] if given is None else given
            out.append(ids if isinstance(ids, RequestError) else self._check(request, ids))
        return out

    def _parts(self, request: BatchRequest) -> np.ndarray | RequestError:
        """A line of several prompts: each encoded and checked as a prompt of its own, then one
        after another, with their token counts in the params (prompt_parts.py)."""
        parts = request.prompt_parts or []
        texts = [p for p in parts if isinstance(p, str)]
        try:
            encoded = iter(self._encode_batch(texts, True) if texts else [])
        except Exception as exc:
            return RequestError(request.index, request.custom_id, "invalid_prompt",
                                f"the tokenizer refused a prompt: {exc}")  # fmt: skip
        checked = []
        for k, part in enumerate(parts):
            given = next(encoded) if isinstance(part, str) else part
            ids = self._check(request, cast(Sequence[int], given))
            if isinstance(ids, RequestError):
                return replace(ids, message=f"prompt {k}: {ids.message}")
            checked.append(ids)
        request.params[PARTS] = [len(ids) for ids in checked]
        return np.concatenate(checked)

    def _chat(self, request: BatchRequest) -> str | RequestError | None:
        if request.messages is None:
            return None  # token ids given
        options = (request.chat_options or ChatOptions()).as_kwargs()
        refused = self._reply_format(request)
        if refused is not None:
            return refused
        try:
            text = self.tokenizer.apply_chat_template(
                request.messages, tools=request.tools, tokenize=False, **options
            )
        except Exception as exc:  # a template may reject any message shape it dislikes
            return RequestError(
                request.index, request.custom_id, "invalid_messages", f"chat template failed: {exc}"
            )
        return str(text)

    def _reply_format(self, request: BatchRequest) -> RequestError | None:
        """Notes in the params what the chat template says of the reply (tool_fields.py): the
        tool-call format its "auto" tool choice is parsed in, whether the model thinks; refuses
        tools the template does not render, and an "auto" choice of a format not parsed here."""
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if thinks(template):
            request.params["reasoning"] = True
        if request.tools is None:
            return None
        form = tool_format(template)
        why = None
        if "tools" not in template:
            why = "the model's chat template does not render tools"
        elif request.params.get("tool_choice") == "auto" and form is None:
            why = ("tool_choice auto (the default with tools) parses the reply in the model's "
                   "tool-call format, and its chat template has none parsed here (Hermes "
                   "<tool_call>, Mistral [TOOL_CALLS], Llama 3 JSON): use tool_choice required "
                   "or a named function, which any model serves")  # fmt: skip
        if why is not None:
            return RequestError(request.index, request.custom_id, "unsupported_field",
                                f"tools are not supported for this model: {why}")  # fmt: skip
        if request.params.get("tool_choice") == "auto":
            request.params["tool_parser"] = form
        return None

    def _encode_texts(
        self, texts: list[str], requests: Sequence[BatchRequest], positions: list[int]
    ) -> dict[int, list[int] | RequestError]:
        if not texts:
            return {}
        # A chat template already holds its special tokens; plain text gets the tokenizer's own.
        plain = [requests[p].messages is None for p in positions]
        out: dict[int, list[int] | RequestError] = {}
        for special in (True, False):
            chosen = [i for i, is_plain in enumerate(plain) if is_plain == special]
            if not chosen:
                continue
            picked, chunk = [requests[positions[i]] for i in chosen], [texts[i] for i in chosen]
            try:
                encoded: list[list[int] | RequestError] = list(self._encode_batch(chunk, special))
            except Exception:  # NOTE: one text the tokenizer refuses must not fail its batch
                encoded = [
                    self._encode_one(r, t, special) for r, t in zip(picked, chunk, strict=True)
                ]
            for request, ids in zip(picked, encoded, strict=True):
                out[request.index] = ids
        return out

    def _encode_one(
        self, request: BatchRequest, text: str, special: bool
    ) -> list[int] | RequestError:
        try:
            return self._encode_batch([text], special)[0]
        except Exception as exc:
            return RequestError(
                request.index,
                request.custom_id,
                "invalid_prompt",
                f"the tokenizer refused the prompt: {exc}",
            )

    def _encode_batch(self, texts: list[str], special: bool) -> list[list[int]]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # The fast tokenizer's own batch call, without offsets: what the Hugging Face wrapper does,
            # at twice the speed.
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
        return list(self.tokenizer(texts, add_special_tokens=special)["input_ids"])

    def _check(
        self, request: BatchRequest, ids: Sequence[int] | np.ndarray
    ) -> np.ndarray | RequestError:
        tokens = np.asarray(ids, dtype=np.int64)
        bad = np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))
        if bad.size:
            value = int(tokens[bad[0]])
            return RequestError(
                request.index,
                request.custom_id,
                "invalid_token_id",
                f"prompt token {value} at position {int(bad[0])} is outside the vocabulary "
                f"[0, {self.vocab_size})",
            )
        if tokens.size == 0:
            return RequestError(
                request.index, request.custom_id, "invalid_prompt", "prompt is empty"
            )
        keep = request.params.get("truncate_prompt_tokens")
        if keep is not None:  # its last tokens, as the engine keeps them (-1: max_model_len)
            tokens = tokens[-(self.max_model_len if keep == -1 else keep) :]
        max_tokens = int(request.params["max_tokens"])
        if tokens.size + max_tokens > self.max_model_len:
            return RequestError(
                request.index,
                request.custom_id,
                "context_length_exceeded",
                f"prompt has {tokens.size} tokens and max_tokens is {max_tokens}; the model's "
                f"maximum context length is {self.max_model_len}",
            )
        return tokens.astype(np.int32)
