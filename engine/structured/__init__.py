"""Structured outputs: decoding constrained to a JSON schema or regex, and the schemas accepted."""
