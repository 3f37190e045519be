import sys

from tuneloop.cli import main

sys.exit(main())
