"""The HTTP edge: FastAPI routers for `/predict`, `/v1` and V2 REST, their dependencies and error tables,
uploads, disconnect watching, telemetry and the pages. Everything here is HTTP; the core knows none of it."""
