"""TokenLoader: tokenised documents from shards, packed into dense rows, on the device."""
from loaders.tokens.loader import TokenLoader
from loaders.tokens.options import DocumentOptions, PackOptions

__all__ = ["DocumentOptions", "PackOptions", "TokenLoader"]
