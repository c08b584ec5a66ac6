"""Triton kernels and their launch helpers, one module per op family.

Library code imports them at the launch site, right after ``ember._dispatch.prepare_triton()`` (which
switches the interpreter on under ``EMBER_FORCE_TRITON=1``), never at module level: ``import ember``
must not import Triton.
"""
