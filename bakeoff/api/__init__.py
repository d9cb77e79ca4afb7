"""Contracts: specs, errors, the verdict and options. Imports nothing else of bakeoff."""
