"""loopd: a local agent runtime for llama-server."""

# A constant, not `importlib.metadata`: every bxctl command reads it, and the metadata lookup
# cost more than the rest of a `bxctl status`. The package's version is read from here.
__version__ = "0.1.0"
__all__ = ["__version__"]
