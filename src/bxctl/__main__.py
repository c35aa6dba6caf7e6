import sys

from bxctl.cli import main

sys.exit(main())
