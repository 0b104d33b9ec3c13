"""parity.dist."""
