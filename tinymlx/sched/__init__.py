"""The scheduler: which sequences run each step, and in what order waiting ones are admitted."""
