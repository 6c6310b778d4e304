"""Typed Cython factor classes: one module per structure family."""
