"""Model families: the canonical op vocabulary and model resolution."""
