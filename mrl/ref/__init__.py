"""mrl.ref."""
