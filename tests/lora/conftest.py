from tests.config.conftest import cli, write_job  # noqa: F401  (the job-file and in-process CLI fixtures of the spec tests)
