"""``python -m control.cli``: run the rpcbuf command."""

import sys

from control.cli.main import main

sys.exit(main())
