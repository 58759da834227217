"""``python -m lengthgen <command> ...`` (e.g. under torchrun)."""

import sys

from lengthgen.cli import main

sys.exit(main())
