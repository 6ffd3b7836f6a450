"""Loggers of this project: Lightning's, with what a person looks for in them made visible."""
