"""Catacloud's framework-free core: providers, agent, policy, CLI, embedded dev services."""

__version__ = "0.2.0"
