"""mrl.checkpoint."""
