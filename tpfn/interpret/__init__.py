"""The interpreter: the only code that touches DTensor, process groups and modules' forwards."""
