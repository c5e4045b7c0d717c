import os

# Keep CPU tests deterministic and light on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
