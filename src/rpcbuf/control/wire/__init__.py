"""The wire: what daemon and client share, with no I/O and no side.

Frames (``frames``) and messages (``protocol``, over the checked field
types of ``fields``; the block tier's in ``blockproto``), run planning for
batches (``runs``), the one tensor-manifest model (``manifest``, its
columns in ``packed``), the error vocabulary (``errors``), tokens
(``auth``), the fleet registry's record (``membership``), model header
checks (``modelcheck``), size and duration notation (``units``), the fp16
wire rules (``gpuops``) and the release (``version``).  Nothing here
imports ``rpcbuf.control.daemon``, ``rpcbuf.control.client`` or
``rpcbuf.control.cli`` (``tests/test_imports.py`` checks it).
"""
