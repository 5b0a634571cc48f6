"""Integrations with training frameworks; each imports its framework itself, only when imported.

``import torchreplicate`` imports none of them.
"""
