"""kvtrace: which process, GPU and Python stack holds each byte of device memory."""

__version__ = "0.1.0"
