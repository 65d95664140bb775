"""tools.doctor."""
