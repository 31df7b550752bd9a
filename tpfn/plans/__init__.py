"""Plans and what a style means on a module: modules enter here; still pure."""
