"""Logging, command-line programs, flags from config dataclasses, atomic files."""
