"""mrl.models."""
