"""``python -m flowseam``: the ``flowseam`` command (:func:`flowseam.cli.main`)."""

import sys

from .cli import main

sys.exit(main())
