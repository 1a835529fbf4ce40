"""
Blazar: one local LLM gateway in front of supervised llama-server children.
"""

__version__ = "0.1.0"
