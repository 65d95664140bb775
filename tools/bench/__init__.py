"""tools.bench."""
