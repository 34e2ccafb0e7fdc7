"""Files rpcbuf reads from disk, each checked before it is trusted: the node's
key file (``keyfile``: the daemon and ``rpcbuf token``) and model-file headers
(``modelheaders``: the loader and the daemon's ``--model-dir`` loads)."""
