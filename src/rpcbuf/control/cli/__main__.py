"""``python -m rpcbuf.control.cli``: run the rpcbuf command."""

import sys

from rpcbuf.control.cli.main import main

sys.exit(main())
