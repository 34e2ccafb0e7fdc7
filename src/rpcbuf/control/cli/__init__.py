"""The ``rpcbuf`` command (``python -m rpcbuf.control.cli``)."""
