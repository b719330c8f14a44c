"""fpemu's version, in a module that imports nothing of fpemu (traces record it; every layer may read it)."""

__version__ = "0.1.0"
