"""meshnode: a peer-to-peer mesh running a GGUF model split by layer ranges."""

__version__ = "0.1.0"
