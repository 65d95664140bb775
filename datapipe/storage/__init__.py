"""datapipe.storage.files."""
