"""Test rigs that need more than a plain pool: simulated hosts in network namespaces (needs root)."""
from lab.testing.hosts import ShapingError, hosts

__all__ = ["hosts", "ShapingError"]
