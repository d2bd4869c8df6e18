"""`python -m jaxinfer ...` runs the command line."""

import sys

from jaxinfer.cli import main

sys.exit(main())
