"""mrl.rollout."""
