"""parity.harness."""
