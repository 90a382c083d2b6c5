"""From logits to answers: sampling parameters, the batched sampler, logprobs, detokenizing, the
n > 1 samples of a prompt and the outputs handed back."""
