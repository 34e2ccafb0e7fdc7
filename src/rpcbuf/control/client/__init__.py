"""The client: ``RpcContext`` and its parts, the cluster and key space, the
buffer pool.  Never imports the daemon, the CLI or the model loader.
"""
