"""`uvicorn app.main:app`: the engine loaded in uvicorn's lifespan, HTTP served by uvicorn, gRPC beside it.

`python -m app` is the recommended way to run the service: there HTTP and gRPC drain together on
SIGTERM. Under uvicorn, uvicorn drains HTTP first and gRPC and the engine after it.
"""

from app.server import LifespanApp

app = LifespanApp()
