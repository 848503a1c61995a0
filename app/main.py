"""The server's app: `uvicorn app.main:app` (settings from VIT_* variables, read at startup)."""

from app.web.app import create_app

app = create_app(exit_on_startup_error=True)
