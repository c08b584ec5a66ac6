"""Integrations with other libraries (imported on demand; none is a dependency of ember)."""
