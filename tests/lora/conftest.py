from tests.config.conftest import write_job  # noqa: F401  (the job-file fixture of the spec tests)
