"""Sampling: the batched sampler and the structured-output masks it applies."""
