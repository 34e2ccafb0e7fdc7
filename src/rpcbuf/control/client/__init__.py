"""The client: the verbs (``context``, which hands each to its part:
``bufferops``, ``rangeops``, ``blockops``, ``tensorops``, ``dedup``,
``attach``), the session's opening, control connection and data paths
(``opening``, ``connection``, ``datapath``), tensors and batches, arrays,
the buffer pool, the cluster, and model loading (``model/``).  Never
imports ``rpcbuf.control.daemon``.
"""
