"""mrl.tracking."""
