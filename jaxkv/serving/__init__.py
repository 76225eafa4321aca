"""The engine (the facade a user drives), the loop that runs it on a thread, and the one
client interface a server talks to it through (``EngineClient``: in this process,
``EngineService``; in a process of its own, ``jaxkv.serving.core.CoreClient``)."""

from jaxkv.serving.client import (BackPressure, Delta, Draining, EngineClient, EngineCommand,
                                  EngineFailed, EngineInfo, Overloaded)
from jaxkv.serving.service import EngineLoop, EngineService

__all__ = ["BackPressure", "Delta", "Draining", "EngineClient", "EngineCommand", "EngineFailed",
           "EngineInfo", "EngineLoop", "EngineService", "Overloaded"]
