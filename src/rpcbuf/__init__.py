"""rpcbuf: remote GPU/host buffers for distributed LLM inference.

Re-exports only: the names are listed in ``__init__.pyi`` and imported on
first use (``lazy_loader``), so the daemon or the CLI never loads the client.
"""

import lazy_loader

from rpcbuf.control.wire.version import VERSION

__version__ = VERSION
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
