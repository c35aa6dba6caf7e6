"""bxctl: the terminal client of loopd."""
