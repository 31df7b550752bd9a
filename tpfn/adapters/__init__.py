"""Adapters from the plans people already have: PyTorch's styles and Hugging Face's tp_plan."""
