"""The ``rpcbuf`` command: argument parsing and output (``main``) and the
commands' work (``commands``).  ``python -m rpcbuf.control.cli`` runs it."""
