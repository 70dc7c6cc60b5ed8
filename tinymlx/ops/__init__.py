"""The math a forward runs: attention over paged K/V, and the CPU's faster ways to the same values."""
