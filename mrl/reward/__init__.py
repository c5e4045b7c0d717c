"""mrl.reward."""
