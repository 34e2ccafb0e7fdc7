"""``load_model``: a model's tensors onto the cluster's nodes, by one of two
sources of bytes.

- ``source="upload"`` (the default, ``loader.py``): the driver reads the
  model and sends each node its share; tensors a node already holds for
  this tenant are placed there instead of sent (dedup re-load).
- ``source="node"`` (``nodeload.py``): every node reads its share from its
  own copy in its ``--model-dir``; the driver reads only the header or the
  hash manifest and sends no tensor bytes.

Both place the same way and lay buffers out the same way, so a model loaded
one way is found in place by a re-load the other way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rpcbuf.control.client.cluster import Cluster
from rpcbuf.control.client.model.loader import LoadResult, load_model as upload_model
from rpcbuf.control.client.model.modelfile import ModelFile
from rpcbuf.control.client.model.nodeload import load_from_node
from rpcbuf.control.wire.errors import BadRequest

SOURCES = ("upload", "node")


async def load_model(cluster: Cluster, path: str | Path | ModelFile,
                     placement: str | None = None, name: str | None = None,
                     progress: bool = True, *, source: str = "upload",
                     node_path: str | None = None, **kw: Any) -> LoadResult:
    """Load the model at ``path`` across ``cluster``: uploaded from here
    (``source="upload"``: see ``loader.load_model`` for ``batch_bytes``,
    ``dedup``, ``on_progress``, ``hash_cache``) or read by every node from
    its own disk (``source="node"``, at ``node_path``, default ``path``:
    see ``nodeload.load_from_node``).  Raises BAD_REQUEST for an unknown
    source, and what the chosen one raises."""
    if source == "upload":
        if node_path is not None:
            raise BadRequest("node_path is for source='node'")
        return await upload_model(cluster, path, placement, name, progress, **kw)
    if source == "node":
        if isinstance(path, ModelFile):
            opened, path = path, path.path
            opened.close()
        kw.pop("dedup", None)  # a node-local load places what is in place anyway
        return await load_from_node(cluster, path, node_path, placement, name, progress, **kw)
    raise BadRequest(f"source must be one of {list(SOURCES)}, got {source!r}")
