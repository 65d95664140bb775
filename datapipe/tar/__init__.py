"""datapipe.tar."""
