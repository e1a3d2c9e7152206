"""`python -m devd`: the same as the `devd` command."""

import sys

from devd.cli import main

sys.exit(main())
