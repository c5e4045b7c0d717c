"""`mrl sft`: supervised fine-tuning on the RL trainer's engine (see `mrl/sft/loop.py`)."""
