import sys

from mrl.cli import main

sys.exit(main())
