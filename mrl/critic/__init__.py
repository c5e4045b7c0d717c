"""mrl.critic."""
