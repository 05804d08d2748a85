"""CUDA kernels (WKV-7 decode and chunked prefill) and their loader.

Importing this package builds nothing: `kernels.loader.load()` builds at first use.
"""
