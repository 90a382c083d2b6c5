"""Structured outputs at batch scale: an extraction job, constrained against unconstrained, side by side
in one process (issue: constrained >= 0.9x unconstrained).

The job: Llama-3.1-8B shapes (random weights, bf16) with the real Llama 3 tokenizer (128k vocabulary:
a mask is as costly as on the real model); N requests sharing one instruction block of --prefix-len
tokens, each with its own --doc-len-token document, answered as a 6-field JSON object
(_common.EXTRACTION_SCHEMA, compact) in at most --max-tokens tokens, greedy.

Modes, each on a fresh engine:
  constrained           json=the schema, with jump-forward (the default: where the grammar allows one
                        token alone, it is appended without a decoding step)
  constrained-stepwise  json=the schema, every token sampled by a step (structured_outputs_jump_forward
                        off); its outputs are compared with the constrained mode's, token for token
  unconstrained         no constraint, each request generating exactly the tokens its constrained run
                        produced (EOS ignored): the same work without the grammar, so wall times compare
The first constrained mode fixes the lengths. Each mode's timed job follows a warm-up on a
small job of the same shape. Prints one JSON line per mode (with the host time spent on masks per
masked step, and the GPU's idle time waiting for masks), then the ratio.

  python benchmarks/structured.py --tokenizer /path/llama3-tokenizer [--requests 6400] [--step-log F]

The tokenizer directory holds Llama 3's tokenizer.json (and a config.json). llama.cpp's vocab file
models/ggml-vocab-llama-bpe.gguf (also inside the llama-cpp-python sdist) becomes one with
  AutoTokenizer.from_pretrained(dir, gguf_file="ggml-vocab-llama-bpe.gguf").save_pretrained(out)
plus a config.json of {"model_type": "llama"}; the GGUF file itself is refused (its decoder reads
newlines as the bytes of "Ċ", which would make every mask wrong).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from typing import Any

import torch

from _common import (
    EXTRACTION_SCHEMA,
    add_engine_args,
    device_name,
    emit,
    ensure_prefixgrove,
    make_llm,
    timed,
)

ensure_prefixgrove()

from prefixgrove import SamplingParams, StructuredOutputsParams  # noqa: E402

MODES = ("constrained", "constrained-stepwise", "unconstrained")


def prompts(n: int, prefix_len: int, doc_len: int, vocab: int, seed: int) -> list[list[int]]:
    """One instruction block shared by all, then each request's own document (random token ids of
    ordinary text tokens: the first 128,000 of Llama 3's vocabulary)."""
    rng = random.Random(seed)
    block = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [block + [rng.randrange(vocab) for _ in range(doc_len)] for _ in range(n)]


def constrained_params(max_tokens: int) -> SamplingParams:
    # Compact JSON: on random weights, free whitespace would let outputs run on to max_tokens.
    constraint = StructuredOutputsParams(json=EXTRACTION_SCHEMA, disable_any_whitespace=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint)


def exact_params(tokens: int) -> SamplingParams:
    # detokenized, as the constrained answers are (a user reads text either way)
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def run_mode(
    mode: str, jobs: list[list[int]], lengths: list[int] | None, args: argparse.Namespace
) -> tuple[dict[str, Any], list[list[int]]]:
    llm = make_llm(
        args,
        structured_outputs_jump_forward=mode != "constrained-stepwise",
    )
    llm.engine.runner.masker.stats.measure_idle = True
    llm.engine.runner.timeline.enabled = True
    llm.engine.runner.timeline.keep_steps = args.step_log is not None
    if mode == "unconstrained":
        assert lengths is not None, "a constrained mode runs first: it fixes the lengths"
        params: list[SamplingParams] = [exact_params(n) for n in lengths]
        warm = [exact_params(n) for n in lengths[: args.warmup]]
    else:
        params = [constrained_params(args.max_tokens)] * len(jobs)
        warm = params[: args.warmup]
    llm.generate([{"prompt_token_ids": p} for p in jobs[: args.warmup]], warm, use_tqdm=False)
    before = _metrics(llm)
    _device_idle(llm)  # forgets the warm-up's
    requests = [{"prompt_token_ids": p} for p in jobs]
    outputs, seconds = timed(lambda: llm.generate(requests, params, use_tqdm=False))
    after = _metrics(llm)
    idle = _device_idle(llm)
    if args.step_log is not None:
        with open(f"{args.step_log}.{mode}.jsonl", "w") as log:
            log.writelines(json.dumps(step) + "\n" for step in llm.engine.runner.timeline.steps)
    if after["mask_steps"]:
        after["mask_ms_per_step"] = 1000 * after["mask_host_seconds"] / after["mask_steps"]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    produced = [len(t) for t in tokens]
    record: dict[str, Any] = {
        "mode": mode,
        "gpu": device_name(),
        "requests": len(jobs),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(jobs) / seconds, 2),
        "output_tokens": sum(produced),
        "output_tokens_per_s": round(sum(produced) / seconds),
        "mean_output_tokens": round(sum(produced) / len(jobs), 1),
        **{k: round(after[k] - before.get(k, 0.0), 4) for k in after},
        **{k: round(v, 3) for k, v in idle.items()},
        # the job's wall time with no step on the device: before its first (taking the requests
        # in, grouping) and after its last (the masks' idle is inside the steps' time)
        "gpu_outside_steps_seconds": round(
            seconds - sum(v for k, v in idle.items() if k != "gpu_idle_for_masks_seconds"), 3
        ),
    }
    if mode != "unconstrained":
        record.update(_validity(outputs))
    return record, tokens


def _metrics(llm: Any) -> dict[str, float]:
    """Steps, and what building masks cost (engine/structured/masks.py MaskStats)."""
    m, masks = llm.engine.metrics, llm.engine.runner.masker.stats
    return {
        "steps": m.steps,
        "decode_steps": m.decode_steps,
        "tokens_jumped": m.tokens_jumped,
        "intake_seconds": m.intake_seconds,
        "host_seconds": m.host_seconds,
        "mixed_seconds": m.mixed_seconds,
        "decode_seconds": m.decode_seconds,
        "mask_steps": masks.steps,
        "mask_rows": masks.rows,
        "mask_rows_reused": masks.rows_reused,
        "matchers_built_ahead": masks.matchers_built_ahead,
        "mask_host_seconds": masks.seconds,
        "mask_fill_seconds": masks.fill_seconds,
        "mask_token_wait_seconds": masks.wait_seconds,
    }


def _device_idle(llm: Any) -> dict[str, float]:
    """The device's time in steps and idle since the last call: inside steps waiting for masks, and
    between steps waiting for the host (engine/runner/step_timeline.py)."""
    runner = llm.engine.runner
    return {
        "gpu_idle_for_masks_seconds": runner.masker.stats.gpu_idle_seconds(),
        **runner.timeline.summary(),
    }


def _validity(outputs: list[Any]) -> dict[str, Any]:
    valid = stopped = 0
    invalid: list[str] = []
    for out in outputs:
        choice = out.outputs[0]
        stopped += choice.finish_reason == "stop"
        try:
            value = json.loads(choice.text)
        except ValueError as e:
            invalid.append(f"{e}: {choice.text!r}")
            continue
        valid += isinstance(value, dict) and set(value) == set(EXTRACTION_SCHEMA["required"])
    return {"valid_json_fraction": round(valid / len(outputs), 4),
            "finished_by_grammar_fraction": round(stopped / len(outputs), 4),
            "invalid_examples": invalid[:3]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_args(ap)
    ap.add_argument("--requests", type=int, default=6400)
    ap.add_argument("--prefix-len", type=int, default=1500)
    ap.add_argument("--doc-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompt-seed", type=int, default=0, help="the random prompts' seed")
    ap.add_argument(
        "--step-log", help="writes each mode's steps (device ms, idle) to STEP_LOG.<mode>.jsonl"
    )
    ap.add_argument(
        "--prompt-vocab", type=int, default=128_000, help="prompt ids are drawn below this"
    )
    args = ap.parse_args()
    if args.tokenizer is None:
        ap.error("--tokenizer is required: Llama 3's tokenizer (a directory or a vocab .gguf)")
    jobs = prompts(
        args.requests, args.prefix_len, args.doc_len, args.prompt_vocab, args.prompt_seed
    )
    lengths: list[int] | None = None
    first: list[list[int]] | None = None  # the first constrained mode's tokens
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        record, tokens = run_mode(mode, jobs, lengths, args)
        gc.collect()  # the mode's engine is gone: give its memory back before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if mode != "unconstrained":
            if first is None:
                first, lengths = tokens, [len(t) for t in tokens]
            else:  # on the GPU a chunk's last bits may differ from a decode step's (bf16)
                same = sum(a == b for a, b in zip(first, tokens, strict=True))
                record["same_tokens_as_first_constrained"] = round(same / len(tokens), 4)
        results[mode] = record
        emit(record)
    if "unconstrained" in results:
        base = results["unconstrained"]["seconds"]
        emit(
            {
                "ratios_vs_unconstrained": {
                    m: round(base / r["seconds"], 3) for m, r in results.items()
                }
            }
        )


if __name__ == "__main__":
    main()
