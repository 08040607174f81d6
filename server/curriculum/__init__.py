"""curriculum."""
