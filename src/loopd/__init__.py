"""loopd: a local agent runtime for llama-server."""

from importlib.metadata import version

__version__ = version("loopd")
__all__ = ["__version__"]
