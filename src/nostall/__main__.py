import sys

from nostall.tools.cli import main

sys.exit(main())
