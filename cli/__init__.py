"""The `sara` command line: the top layer (DESIGN §2); nothing below imports it."""
