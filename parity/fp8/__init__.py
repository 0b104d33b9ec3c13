"""parity.fp8."""
