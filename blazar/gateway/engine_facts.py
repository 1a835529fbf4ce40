"""
What the web layer needs from the engines room, reached through the
gateway: the web never imports C{blazar.engines} (an import-linter
contract says so), so the few engine facts a surface shows (a model's
kind, whether it sees images, its context per slot), the stream framing
its encoders share and the bench comparison the dashboard shows are named
here.
"""

from __future__ import annotations

from blazar.engines.bench import compare
from blazar.engines.llamacpp import context_per_slot, model_kind, sees_images
from blazar.engines.sse import EventTooLong, WholeEvents

__all__ = ["EventTooLong", "WholeEvents", "compare", "context_per_slot", "model_kind", "sees_images"]
