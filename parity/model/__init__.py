"""parity.model."""
