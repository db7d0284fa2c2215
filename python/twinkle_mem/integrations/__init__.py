"""Integrations of twinkle-mem into training frameworks (each imported on demand)."""
