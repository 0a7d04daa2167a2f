"""`python -m hfrt` is the `hfrt` command."""

import sys

from hfrt.cli import main

sys.exit(main())
