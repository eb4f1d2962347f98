import sys

from ptdp.cli import main

sys.exit(main())
