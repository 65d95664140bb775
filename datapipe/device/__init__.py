"""datapipe.device."""
