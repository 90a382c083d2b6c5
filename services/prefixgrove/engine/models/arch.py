"""The architecture facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixgrove.catalog.context import sliding_window

from .rotary import rope_parameters, supported_rope_types


def architecture_of(hf_config: Any) -> str:
    """The config's first `architectures` entry (LlamaForCausalLM when it names none); whether it
    is supported is `registry.model_class`'s to say."""
    return str((getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0])


@dataclass(frozen=True)
class MoeArch:
    """A mixture-of-experts MLP's facts: experts, the top-k each token goes to, each expert's
    width, whether the top-k weights are renormalized, a shared expert's width (0: none), and which
    layers are sparse (the others keep a dense MLP of the config's intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    sparse_layers: tuple[int, ...]


def moe_arch_of(config: Any, num_layers: int) -> MoeArch | None:
    """MoeArch of Qwen3-MoE, Qwen2-MoE and Mixtral configs; None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return None
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return MoeArch(
        num_experts=int(experts),
        top_k=int(config.num_experts_per_tok),
        # Mixtral's experts are its intermediate_size wide; the Qwen MoE configs name theirs
        intermediate_size=int(
            getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        ),
        # Mixtral always renormalizes the top-k (softmax over them); Qwen's configs say
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
        shared_intermediate_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class GemmaArch:
    """Gemma 2 and 3's facts beyond the Llama decoder: the attention scale's 1 / sqrt of
    query_pre_attn_scalar, the attention-logit and final-logit soft-caps (0: none), each layer's
    sliding window (0: a global layer) and Gemma 3's rotary base of its local layers (None: the
    local layers share the global table)."""

    query_pre_attn_scalar: float
    attn_softcap: float
    final_softcap: float
    layer_windows: tuple[int, ...]
    local_rope_theta: float | None


def gemma_arch_of(config: Any, arch: str) -> GemmaArch | None:
    """GemmaArch of Gemma 2 and Gemma 3 text configs; None for other architectures."""
    if arch not in GEMMA_ARCHITECTURES:
        return None
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{arch} with hidden_activation={activation!r}: only gelu_pytorch_tanh")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{arch} with use_bidirectional_attention: only causal attention")
    window = int(config.sliding_window or 0)
    kinds = config.layer_types or ["full_attention"] * config.num_hidden_layers
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{arch} layer types {unknown}: expected sliding_ or full_attention")
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"{arch}: local layers' rope type {local['rope_type']!r}: only default"
            )
        local_theta = float(
            local.get("rope_theta") or getattr(config, "rope_local_base_freq", None) or 10000.0
        )
    return GemmaArch(
        query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        layer_windows=tuple(window if kind == "sliding_attention" else 0 for kind in kinds),
        local_rope_theta=local_theta,
    )


# ModelArch's fields that a transformers config holds as they are: ours -> the config's name
_AS_IN_HF_CONFIG = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}


@dataclass(frozen=True)
class ModelArch:
    """Shapes and switches of a Llama-family decoder; one type covers Llama 2/3, Mistral, Qwen2 and Qwen3."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 (and Llama configs with attention_bias)
    qk_norm: bool  # Qwen3 and Gemma 3: RMSNorm on each head of q and k before rotary
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoeArch | None = None
    gemma: GemmaArch | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.rope_type not in supported_rope_types():
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; supported: "
                f"{', '.join(supported_rope_types())}"
            )

    @property
    def rope_type(self) -> str:
        return str(rope_parameters(self.rope_theta, self.rope_scaling)["rope_type"])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        arch = architecture_of(config)
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope_params = getattr(config, "rope_parameters", None)  # transformers >= 5
        scaling = getattr(config, "rope_scaling", None)
        theta = getattr(config, "rope_theta", None)
        partial = (rope_params if isinstance(rope_params, dict) else {}).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        if partial not in (None, 1.0):
            raise ValueError(
                f"partial_rotary_factor={partial} of {arch} is not supported: rotary embeddings "
                "cover the whole head here"
            )
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv={config.clip_qkv} of {arch} is not supported")
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
            # Gemma 3's rope per layer type (rope_scaling then holds the same dict): the global
            # layers' here, the local layers' base in GemmaArch
            rope_params, scaling = rope_params["full_attention"], None
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta", theta)
            if rope_params.get("rope_type", "default") != "default":
                scaling = dict(rope_params)
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        return cls(
            architecture=arch,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(getattr(config, "attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=sliding_window(config),
            eos_token_ids=eos_ids,
            moe=moe_arch_of(config, config.num_hidden_layers),
            gemma=gemma_arch_of(config, arch),
            **{ours: getattr(config, theirs) for ours, theirs in _AS_IN_HF_CONFIG.items()},
        )
