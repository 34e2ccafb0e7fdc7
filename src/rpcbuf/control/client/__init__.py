"""The client: ``RpcContext`` and its parts, the cluster and key space, the
buffer pool and model loading (``model/``).  Never imports the daemon.
"""
