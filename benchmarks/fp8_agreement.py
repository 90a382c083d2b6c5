"""FP8 against the unquantized model, teacher-forced, on the trained SmolLM2-135M-Instruct: the
unquantized engine samples continuations of chat prompts (temperature 1, seeded), then both engines
score the same sequences. At every continuation position: whether FP8's top-1 token is the
unquantized model's, and log p(x) - log q(x) of the sampled token x, whose mean over positions is an
unbiased estimate of the mean per-token KL(unquantized || FP8), since x is drawn from p.

With --continuation greedy the unquantized engine continues greedily instead (as trained_agreement.py
does): top-1 agreement on the model's own most likely text, and the mean log p(x) - log q(x) of the
token that follows, which is then no longer an estimate of the KL.

Variants: `weights` (quantization="fp8": weights per output channel, activations per token); with
--blocks, `blocks` (the same with fp8_block_scales=True: 128x128 weight blocks, activations per token
and 128 columns); with --kv, `kv` (kv_cache_dtype="fp8") and `both`. Prints one JSON line per variant.

  python3 fp8_agreement.py --prompts 32 --tokens 64            # 2,048 positions
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from _common import ROOT, chat_prompts, device_name, emit, prompt_scores, teacher_forced, top1

VARIANTS = {
    "weights": {"quantization": "fp8"},
    "kv": {"kv_cache_dtype": "fp8"},
    "both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    "blocks": {"quantization": "fp8", "fp8_block_scales": True},
}


def compare(prompts: list[list[int]], sequences: list[list[int]], ref: list[Any],
            ours: list[Any], sampled: bool) -> dict[str, Any]:  # fmt: skip
    agree = total = 0
    kl = 0.0
    for i, token, ref_lp, our_lp in teacher_forced(prompts, sequences, ref, ours):
        agree += int(top1(ref_lp[i]) == top1(our_lp[i]))
        kl += ref_lp[i][token].logprob - our_lp[i][token].logprob
        total += 1
    return {
        "positions": total,
        "top1_agreement": round(agree / total, 5),
        ("mean_kl_per_token" if sampled else "mean_logprob_gap"): round(kl / total, 6),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--dtype", default="auto", help="the unquantized model's (and FP8's activations)"
    )
    ap.add_argument("--kv", action="store_true", help="also kv_cache_dtype='fp8' alone and both")
    ap.add_argument("--blocks", action="store_true", help="also fp8_block_scales=True")
    ap.add_argument("--continuation", choices=["sampled", "greedy"], default="sampled")
    args = ap.parse_args()
    from prefixgrove import LLM, SamplingParams

    base = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    prompts = chat_prompts(base.get_tokenizer(), args.prompts)
    sampled = args.continuation == "sampled"
    temperature = 1.0 if sampled else 0.0
    sample = SamplingParams(
        max_tokens=args.tokens, temperature=temperature, seed=0, ignore_eos=True
    )
    outs = base.generate([{"prompt_token_ids": p} for p in prompts], sample, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    ref = prompt_scores(base, sequences)
    dtype = str(base.engine.config.model.dtype).removeprefix("torch.")
    del base
    variants = [
        "weights",
        *(["blocks"] if args.blocks else []),
        *(["kv", "both"] if args.kv else []),
    ]
    for variant in variants:
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, **VARIANTS[variant])
        emit({"benchmark": "fp8_agreement", "model": args.model, "device": device_name(),
              "variant": variant, "dtype": dtype, "continuation": args.continuation,
              "prompts": len(prompts), "tokens": args.tokens,
              **compare(prompts, sequences, ref, prompt_scores(llm, sequences), sampled)})  # fmt: skip
        del llm


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
