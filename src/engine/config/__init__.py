"""Config schema and resolvers. Imports only omegaconf/hydra so `--help` stays fast."""

from engine.config.resolvers import register_resolvers
from engine.config.schema import register_schemas


def register() -> None:
    """Call before @hydra.main composes anything."""
    register_resolvers()
    register_schemas()
