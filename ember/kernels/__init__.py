"""Triton kernels and their launch helpers, one module per op family.

Never import these modules directly from library code: go through ``ember._dispatch.kernels(name)``,
which keeps Triton a lazy import and switches the interpreter on under ``EMBER_FORCE_TRITON=1``.
"""
