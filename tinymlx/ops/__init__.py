"""The math a forward runs, through one set of kernels chosen at load (kernels.py): the portable ones
(plain MLX: portable.py, attention.py) or the CPU's faster ways to the same values (cpu/)."""
