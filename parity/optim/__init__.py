"""parity.optim."""
