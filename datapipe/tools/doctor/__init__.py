"""datapipe.tools.doctor."""
