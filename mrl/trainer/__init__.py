"""mrl.trainer."""
