"""Model files onto nodes: parsing and checking GGUF/safetensors headers
(``modelfile``, ``modelcheck``), placement, the loader and its hash cache."""
