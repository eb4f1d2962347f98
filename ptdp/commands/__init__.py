"""One module per `ptdp` command: its parser and its run function (argument
handling, printing, exit codes). Each imports no torch at import time, so
that every --help, an argument error and the commands that need no model
start fast; a command imports the code it runs when it runs. ptdp.cli
builds the top-level parser from them and routes to them."""
