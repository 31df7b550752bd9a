"""Styles: pure values that say how to parallelize one module (no torch.nn, no DTensor)."""
