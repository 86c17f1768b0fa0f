import sys

from scruffy.controller import main

sys.exit(main())
