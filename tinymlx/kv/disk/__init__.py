"""The prefix cache's disk tier: block files, their store, the writer thread, the model's fingerprint."""
