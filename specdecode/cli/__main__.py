"""`python -m specdecode.cli`, the same as the `specdecode` command."""

import sys

from specdecode.cli import main

sys.exit(main())
