"""``python -m rpcbuf.control.daemon``: run rpcbufd."""

import sys

from rpcbuf.control.daemon.service.main import main

sys.exit(main())
