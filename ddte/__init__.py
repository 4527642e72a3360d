"""ddte: neural expansion selector for lossless multi-path speculative decoding."""

__version__ = "0.1.0"
