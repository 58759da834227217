"""Data: synthetic tasks generated on the fly at any length, and text corpora."""
