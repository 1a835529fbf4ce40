"""
twistd plugin stub: C{twistd -n blazar --config PATH}.

Kept lazy on purpose: twistd imports every plugin module to list them, so this
file names L{blazar.tap} and imports nothing of Blazar's.
"""

from twisted.application.service import ServiceMaker

blazar = ServiceMaker(
    "Blazar",
    "blazar.tap",
    "Local LLM gateway: OpenAI, Ollama and Anthropic APIs over llama-server children.",
    "blazar",
)
