"""The fleet prior as a value: its parts, its file, and what consumes it."""
