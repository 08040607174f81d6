"""The curricula that ship with proctor, as package data; ``proctor.server.shipped`` finds them by name."""
