"""datapipe.order."""
