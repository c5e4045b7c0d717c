"""mrl.actor."""
