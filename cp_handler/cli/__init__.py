"""Command-line entry points (``cp-train``)."""
