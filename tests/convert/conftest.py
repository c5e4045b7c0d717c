from tests.cli.conftest import cli   # noqa: F401  (mrl in-process)
from tests.config.conftest import write_job   # noqa: F401  (a small valid job)
