import sys

from scruffy.cli import main

sys.exit(main())
