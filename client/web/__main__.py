"""`python -m client.web` is `swarm-chat`."""

import sys

from client.web.cli import main

sys.exit(main())
