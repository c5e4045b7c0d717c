"""mrl.data."""
