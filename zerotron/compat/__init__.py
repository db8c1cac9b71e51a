"""The DeepSpeed-shaped surface: an edge package that imports zerotron's core and is never imported by it."""
