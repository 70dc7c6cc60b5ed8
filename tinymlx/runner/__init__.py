"""A scheduled batch -> the step's device inputs -> one forward -> logits."""
