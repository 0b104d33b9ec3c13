"""pytest plugin: parity scenarios as parametrized tests (filled in by the harness)."""
