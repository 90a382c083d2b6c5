"""FP8 against the unquantized model, teacher-forced, on the trained SmolLM2-135M-Instruct: the
unquantized engine samples continuations of chat prompts (temperature 1, seeded), then both engines
score the same sequences. At every continuation position: whether FP8's top-1 token is the
unquantized model's, and log p(x) - log q(x) of the sampled token x, whose mean over positions is an
unbiased estimate of the mean per-token KL(unquantized || FP8), since x is drawn from p.

Variants: `weights` (quantization="fp8"), and with --kv, `kv` (kv_cache_dtype="fp8") and `both`.
Prints one JSON line per variant.

  python3 fp8_agreement.py --prompts 32 --tokens 64            # 2,048 positions
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trained_agreement import QUESTIONS, SYSTEMS

from _common import ROOT, device_name, emit

VARIANTS = {
    "weights": {"quantization": "fp8"},
    "kv": {"kv_cache_dtype": "fp8"},
    "both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def score(llm: Any, sequences: list[list[int]]) -> list[Any]:
    """Each sequence's prompt logprobs: per position the token's logprob and the top-1 token."""
    from prefixgrove import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [out.prompt_logprobs for out in outs]


def compare(prompts: list[list[int]], sequences: list[list[int]], ref: list[Any],
            ours: list[Any]) -> dict[str, Any]:  # fmt: skip
    agree = total = 0
    kl = 0.0
    for prompt, seq, ref_lp, our_lp in zip(prompts, sequences, ref, ours, strict=True):
        for i in range(len(prompt), len(seq)):
            top = [next(t for t, lp in e.items() if lp.rank == 1) for e in (ref_lp[i], our_lp[i])]
            agree += int(top[0] == top[1])
            kl += ref_lp[i][seq[i]].logprob - our_lp[i][seq[i]].logprob
            total += 1
    return {
        "positions": total,
        "top1_agreement": round(agree / total, 5),
        "mean_kl_per_token": round(kl / total, 6),
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
    args = ap.parse_args()
    from prefixgrove import LLM, SamplingParams

    base = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    tokenizer = base.get_tokenizer()
    conversations = [
        [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
         {"role": "user", "content": QUESTIONS[(i // len(SYSTEMS) + i) % len(QUESTIONS)]}]
        for i in range(args.prompts)
    ]  # fmt: skip
    prompts = [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        for c in conversations
    ]  # fmt: skip
    sample = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0, ignore_eos=True)
    outs = base.generate([{"prompt_token_ids": p} for p in prompts], sample, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    ref = score(base, sequences)
    dtype = str(base.engine.config.model.dtype).removeprefix("torch.")
    del base
    for variant in ["weights", "kv", "both"] if args.kv else ["weights"]:
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, **VARIANTS[variant])
        emit({"benchmark": "fp8_agreement", "model": args.model, "device": device_name(),
              "variant": variant, "dtype": dtype, "prompts": len(prompts), "tokens": args.tokens,
              **compare(prompts, sequences, ref, score(llm, sequences))})  # fmt: skip
        del llm


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
