"""faults."""
