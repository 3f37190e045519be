"""`python -m tuneloop` is the `tuneloop` command (clients start local servers this way)."""

import sys

from tuneloop.cli import main

sys.exit(main())
