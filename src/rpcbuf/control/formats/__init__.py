"""The files rpcbuf reads, both sides alike: the node's key file (``keyfile``) and
model-file headers (``modelheaders``), each checked before it is trusted."""
