"""The HTTP API: thin routers, one file per resource. Validates everything; meters nothing yet."""
