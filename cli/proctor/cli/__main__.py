"""``python -m proctor.cli ...``: the ``proctor`` command, for when the console script is not on PATH."""

import sys

from proctor.cli.main import main

sys.exit(main())
