import sys

from mrl.platform.lifetime import boot

boot()   # first: ranks die with their launcher; children cannot read this process's secrets

from mrl.cli import main  # noqa: E402

sys.exit(main())
