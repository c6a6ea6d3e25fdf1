"""`python -m posttrain ...` is the same as the `posttrain` command."""

import sys

from posttrain.cli import main

sys.exit(main())
