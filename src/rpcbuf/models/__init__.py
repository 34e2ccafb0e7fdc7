"""Model files onto nodes: headers, placement, the loaders, their hash cache."""
