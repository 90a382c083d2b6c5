"""Structured outputs: a request's output held to a JSON schema, regex, choice list or grammar.

`params` is the request side (vLLM's StructuredOutputsParams), `grammars` compiles it for the model's
vocabulary (llguidance) and refuses one no output can meet (`derivations`: grammars whose rules never
end), `grammar_state` keeps each constrained sequence's matcher and whether its constraint still holds
(a matcher that fails ends its request as an error), and `masks` builds a step's token masks, which
the sampler applies on the device in one kernel.
"""

from .params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
