"""The ``rpcbuf`` command (``python -m rpcbuf.cli``)."""
