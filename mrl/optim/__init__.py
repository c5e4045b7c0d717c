"""mrl.optim: optimizer and learning-rate schedule."""
