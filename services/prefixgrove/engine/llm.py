"""vLLM-compatible offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm import tqdm

from prefixgrove.catalog.generation import generation_defaults
from prefixgrove.grouping import GroupingConfig, PrefixGroup, group_prompts

from .config import EngineConfig
from .core.llm_engine import LLMEngine
from .request_feed import RequestFeed, feed_window
from .sampling.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from .sampling.parallel_samples import Samples
from .sampling.pooling_params import PoolingParams
from .sampling.sampling_params import SamplingParams, is_unicode
from .vllm_args import check_request_options, engine_kwargs, unsupported_method

Prompt = str | dict[str, Any]
Conversation = Seq[dict[str, Any]]
# What a TextPrompt or TokensPrompt may hold here (prefixgrove.inputs): no multimodal data; a
# cache_salt is taken and changes nothing, since one job's prefix cache serves one caller.
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


class LLM:
    """One model on one device, generating for whole batches of prompts.

    With `enable_prefix_grouping` (the default) the prompts of a `generate` call are grouped by shared
    prefix first, and each prefix is computed once; `groups=` takes groups formed elsewhere (the
    planner's, over positions in `prompts`) and uses them as they are.
    """

    def __init__(
        self,
        model: str,
        *,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._generation_defaults = generation_defaults(
            model, generation_config, override_generation_config
        )
        try:
            SamplingParams(**self._generation_defaults)
        except ValueError as e:
            raise ValueError(
                f"the default sampling of {model} (generation_config={generation_config!r}, "
                f"override_generation_config={override_generation_config!r}): {e}"
            ) from None
        self.engine = LLMEngine(EngineConfig.create(model, **engine_kwargs(kwargs)))
        self._batches = 0

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine underneath, under vLLM's attribute name."""
        return self.engine

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block (vLLM's `LLM.reset_prefix_cache`); True, as it always
        succeeds here (no request holds a block between calls)."""
        self.engine.reset_prefix_cache()
        return True

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`): the model's last hidden states pooled as
        `pooling_params` say (pooling_params.py; None: the model's own pooling). Prompts that
        share a prefix share its computation, as in `generate`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        each = pooling_params if isinstance(pooling_params, Seq) else [pooling_params]
        params = [
            SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                           truncate_prompt_tokens=truncate_prompt_tokens,
                           pooling=pooling or PoolingParams())
            for pooling in each
        ]  # fmt: skip
        outputs = self.generate(prompts, params if len(params) > 1 else params[0], use_tqdm,
                                lora_request)  # fmt: skip
        return [
            EmbeddingRequestOutput(
                out.request_id, EmbeddingOutput(out.outputs[0].embedding or []),
                out.prompt_token_ids,
            )
            for out in outputs
        ]  # fmt: skip

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        raise unsupported_method("beam_search")

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise unsupported_method("encode")

    def classify(self, *args: Any, **kwargs: Any) -> Any:
        raise unsupported_method("classify")

    def score(self, *args: Any, **kwargs: Any) -> Any:
        raise unsupported_method("score")

    def reward(self, *args: Any, **kwargs: Any) -> Any:
        raise unsupported_method("reward")

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's own defaults (its generation_config.json) over SamplingParams' defaults,
        as vLLM gives them; what `generate` uses when no sampling_params are passed."""
        return SamplingParams(**self._generation_defaults)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        *,
        priority: Seq[int] | None = None,
        groups: Seq[PrefixGroup] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        check_request_options(lora_request, priority, len(prompts))
        texts, token_ids = self._tokenize(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._params_per_prompt(sampling_params, len(token_ids))
        self._check_job(token_ids, params)
        self._batches += 1
        jobs = Samples.of(self._batches, params)
        prompt_ids = token_ids
        texts, token_ids, params = jobs.expand(texts), jobs.expand(token_ids), jobs.params(params)
        if groups is None:
            groups = self._group(token_ids) if self.config.enable_prefix_grouping else []
        else:
            groups = jobs.groups(groups, prompt_ids)
        request_ids = jobs.request_ids
        results: dict[str, RequestOutput] = {}
        for finished in self.run_requests(request_ids, token_ids, params, groups, use_tqdm, texts):
            results.update((out.request_id, out) for out in finished)
        outputs = [results[rid] for rid in request_ids]
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text  # a grouped request's text too: the engine took only its ids
        return jobs.merge(outputs)

    def chat(
        self,
        messages: Conversation | Seq[Conversation],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or to a
        list of them, as vLLM's `LLM.chat`: each is rendered with the model's chat template (or
        `chat_template`) exactly as transformers' `apply_chat_template` renders and tokenizes it,
        `tools` (OpenAI's function definitions) with it. As vLLM's, the replies are text: tool
        calls are parsed in batch files' answers (services.md)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be true: the reply "
                "either starts a new assistant message or continues the last one"
            )
        batch = [messages] if _is_conversation(messages) else list(messages)
        conversations = cast(list[Conversation], batch)
        options = dict(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **(chat_template_kwargs or {}),
        )
        prompts = [self._render_chat(c, i, options) for i, c in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _render_chat(
        self, conversation: Conversation, index: int, options: dict[str, Any]
    ) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(
                "chat() renders conversations with the tokenizer, which skip_tokenizer_init=True "
                "leaves out: pass token ids to generate() instead"
            )
        if options["chat_template"] is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"model {self.config.model.model!r} has no chat template: pass chat_template=... "
                "or use generate() with plain prompts"
            )
        try:
            text = tokenizer.apply_chat_template(list(conversation), tokenize=False, **options)
        except Exception as exc:  # a template may refuse any message shape it dislikes
            raise ValueError(f"conversation {index}: the chat template failed: {exc}") from None
        # The rendered template holds its own special tokens (transformers encodes it so too).
        return {
            "prompt": text,
            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
        }

    def _tokenize(self, prompts: Seq[Prompt]) -> tuple[list[str | None], list[list[int]]]:
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict) and not _PROMPT_KEYS.issuperset(p):
                raise ValueError(
                    f"prompt {i}: {', '.join(sorted(set(p) - _PROMPT_KEYS))} not supported (only "
                    "text is served): a prompt is a string, a TextPrompt {'prompt'} or a "
                    "TokensPrompt {'prompt_token_ids'}"
                )
            text = p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None
            if isinstance(text, str) and not is_unicode(text):
                raise ValueError(f"prompt {i} holds a lone surrogate: it is not Unicode text")
            if isinstance(p, dict) and "prompt_token_ids" in p:
                texts.append(p.get("prompt"))
                ids.append(p["prompt_token_ids"])  # checked (and copied where needed) by validate
            elif isinstance(text, str):
                texts.append(text)
                ids.append(self._encode(i, text))
            else:
                raise ValueError(
                    f"prompt {i}: expected a string, {{'prompt': str}} or "
                    f"{{'prompt_token_ids': [...]}}, got {type(p).__name__}"
                )
        return texts, ids

    def _encode(self, index: int, text: str) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(
                f"prompt {index} is text, but skip_tokenizer_init=True loaded no tokenizer to "
                "encode it: pass {'prompt_token_ids': [...]} instead"
            )
        return cast(list[int], tokenizer.encode(text))

    @staticmethod
    def _params_per_prompt(
        sp: SamplingParams | Seq[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        if len(sp) != n:
            raise ValueError(
                f"got {len(sp)} sampling_params for {n} prompts; give one, or one per prompt"
            )
        return list(sp)

    def _check_job(self, token_ids: list[list[int]], params: list[SamplingParams]) -> None:
        """The whole job is checked before any of it is queued, once: each params object becomes the
        engine's checked copy, each prompt its checked (and truncated) ids."""
        prepared: dict[int, SamplingParams] = {}
        for i, (ids, sp) in enumerate(zip(token_ids, params, strict=True)):
            try:
                if id(sp) not in prepared:
                    prepared[id(sp)] = self.engine.prepare(sp)
                params[i] = prepared[id(sp)]
                token_ids[i] = self.engine.validate(ids, params[i])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None

    def _group(self, token_ids: list[list[int]]) -> list[PrefixGroup]:
        block_size = self.config.cache.block_size
        # No group may need more than the whole cache: a bigger one is split into groups of one prefix.
        capacity = self.engine.blocks.num_usable * block_size
        smallest = GroupingConfig(block_size=block_size).min_shared_len + 2  # the least it accepts
        config = GroupingConfig(block_size=block_size, max_group_tokens=max(capacity, smallest))
        return group_prompts(token_ids, config).groups

    def run_requests(
        self,
        request_ids: list[str],
        token_ids: list[list[int]],
        params: list[SamplingParams],
        groups: Seq[PrefixGroup],
        use_tqdm: bool | Callable[..., tqdm] = True,
        texts: list[str | None] | None = None,
    ) -> Iterator[list[RequestOutput]]:
        """Hands the engine requests whose ids `LLMEngine.validate` returned, with their groups
        (positions in these lists), a window at a time (request_feed.py), and yields the requests
        each engine step finishes: `generate` and the local run both drive the engine through this.

        While it runs, the job's objects are frozen for the garbage collector: its prompts (millions
        of ids in lists) and sequences live until it ends, and frozen, collections skip them instead
        of walking every list again. gc.unfreeze() also thaws what was frozen before (some
        interpreters start with objects frozen): freezing only spares collections work, so that
        costs speed at most, where leaving the engine's objects frozen would keep its reference
        cycles, and the GPU memory they hold, alive after the engine is gone."""
        texts = texts or [None] * len(request_ids)
        window = feed_window(self.config.scheduler.max_num_seqs)
        feed = RequestFeed(self.engine, request_ids, texts, token_ids, params, groups, window)
        # vLLM takes a tqdm-like callable too (a notebook's, or one with other settings)
        progress = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        gc.freeze()
        try:
            feed.top_up()
            while self.engine.has_unfinished_requests():
                finished = self.engine.step()
                if not finished:
                    continue
                feed.finished(len(finished))
                feed.top_up()  # before the last of them finish: the engine never runs dry
                yield finished  # the caller takes them in before the bar counts them
                out_tokens += sum(len(c.token_ids) for out in finished for c in out.outputs)
                bar.update(len(finished))
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(out_tok_s=f"{out_tokens / elapsed:.0f}", refresh=False)
        finally:
            gc.unfreeze()
            bar.close()


def _is_conversation(messages: Any) -> bool:
    """One conversation is a list of message dicts; a batch is a list of such lists."""
    return bool(messages) and isinstance(messages[0], dict)
