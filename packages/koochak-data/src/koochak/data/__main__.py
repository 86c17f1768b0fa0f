"""``python -m koochak.data``: the same as the ``koochak-data`` command."""

import sys

from koochak.data.cli import main

sys.exit(main())
