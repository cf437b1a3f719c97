"""Foundations every package may use, importing no feature package."""
