"""The client: the control connection and the verbs (``context``), tensors
and batches, dedup uploads, arrays, the buffer pool, the cluster, and model
loading (``model/``).  Never imports ``rpcbuf.control.daemon``.
"""
