"""The wire: what daemon and client share, with no I/O and no side.

Frames and messages (``protocol``), run planning for batches (``runs``), the
one tensor-manifest model (``manifest``), the error vocabulary (``errors``),
tokens (``auth``), size and duration notation (``units``) and the fp16 wire
rules (``gpuops``).  Nothing here imports ``rpcbuf.control.daemon``, ``rpcbuf.control.client`` or
``rpcbuf.control.cli`` (``tests/test_imports.py`` checks it).
"""
