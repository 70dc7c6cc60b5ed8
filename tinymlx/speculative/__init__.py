"""Speculative decoding: the proposers, the draft planner and its learned step-cost curve."""
