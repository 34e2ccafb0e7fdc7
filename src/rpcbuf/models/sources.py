"""``load_model`` by one of two sources: ``"upload"`` (the driver sends each node
its share, dedup against what it holds) or ``"node"`` (each node reads its own
copy under ``--model-dir``).  Both lay buffers out alike, so either finds the
other's load in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rpcbuf.control.client.cluster import Cluster
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.models.loader import LoadResult, load_model as upload_model
from rpcbuf.models.modelfile import ModelFile
from rpcbuf.models.nodeload import load_from_node

SOURCES = ("upload", "node")


async def load_model(cluster: Cluster, path: str | Path | ModelFile,
                     placement: str | None = None, name: str | None = None,
                     progress: bool = True, *, source: str = "upload",
                     node_path: str | None = None, **kw: Any) -> LoadResult:
    """Load the model at ``path`` across ``cluster`` (arguments as
    ``loader.load_model`` / ``nodeload.load_from_node``).  Raises BAD_REQUEST for
    an unknown source, and what the chosen one raises."""
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
