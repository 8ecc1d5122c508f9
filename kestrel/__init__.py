"""Kestrel: a fast Moondream 2 serving runtime built around a namespaced radix prefix cache."""

from __future__ import annotations

__version__ = "0.1.0"
