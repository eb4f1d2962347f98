"""The `ptdp` commands, one module each: its parser and its run function
(argument checks, printing, exit codes). Torch-free at import, so that the
command line starts fast; ptdp.cli routes to them."""
