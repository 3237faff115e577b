"""A fake of NVIDIA's cupti-python 13.0 for kvtrace's tests: `from cupti import cupti` gives cupti.py here.
As in the real package, the top-level module holds nothing but the name of its one module."""
__all__ = ["cupti"]
