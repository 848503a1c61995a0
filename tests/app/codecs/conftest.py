from tests.app.core.conftest import service

__all__ = ["service"]
