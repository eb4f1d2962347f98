"""Hardware pricing: profiles of machines, and what kernels, operators,
collectives and whole layers cost on them, in seconds."""
