"""The KV cache: blocks and their tables, state slots, the prefix cache, the device pools, the disk tier."""
