"""``python -m rpcbuf.cli``: run the rpcbuf command."""

import sys

from rpcbuf.cli.main import main

sys.exit(main())
