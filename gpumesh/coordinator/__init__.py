"""The coordinator: the ROUTER broker that queues tasks, leases them to workers and keeps results."""

from .broker import Broker, Event
from .server import Coordinator

__all__ = ["Broker", "Coordinator", "Event"]
