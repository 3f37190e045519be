"""Storage: metadata registry (SQLAlchemy), API keys, and where checkpoint files live."""
