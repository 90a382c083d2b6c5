"""Which models can be named and what they are: built-in presets and local checkpoints, their
Hugging Face configs, tokenizers and context limits. Loads no weights, so the planner, the worker and
the engine all resolve a model name here, the same way.
"""
