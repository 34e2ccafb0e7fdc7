"""rpcbuf: remote GPU/host buffers for distributed LLM inference.

The public face only re-exports; the logic lives in ``rpcbuf.control`` and
``rpcbuf.dataplane``.  The names are listed in ``__init__.pyi`` and imported on
first use (``lazy_loader``): a process that imports only a part, such as the
daemon (``rpcbuf.control.daemon``) or the CLI, never loads the client for it.
"""

import lazy_loader

from rpcbuf.control.wire.version import VERSION

__version__ = VERSION
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
