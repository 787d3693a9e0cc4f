"""zerospeed's version (one place; `zerospeed.__version__` and checkpoints read it)."""

__version__ = "0.1.0"
