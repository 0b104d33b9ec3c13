"""parity.ddp."""
