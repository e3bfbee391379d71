"""mm's version: the one place it is written (setup.cfg reads it; `mm --version` prints it without loading
importlib.metadata, ~30 ms of every start)."""
__version__ = "0.1.0"
