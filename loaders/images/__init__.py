"""loaders.images.loader."""
