import sys

from loopd.cli import main

sys.exit(main())
