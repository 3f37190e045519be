"""The engine: the `Backend` protocol and its implementations. Knows no HTTP and no database."""
