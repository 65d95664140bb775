"""datapipe.tools.bench."""
