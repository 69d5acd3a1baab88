"""Pydantic models shared by every layer. This package imports nothing else of ours."""
