"""``python -m control.daemon``: run rpcbufd."""

import sys

from control.daemon.main import main

sys.exit(main())
