"""`uvicorn app.main:app`: the engine loaded in uvicorn's lifespan, HTTP served by uvicorn, gRPC beside it.

`python -m app` is the recommended way to run the service (it also runs serving processes, VIT_WORKERS). Under
uvicorn the service listens before the models load and drains on SIGTERM as it does there: the lifespan answers
what was accepted with uvicorn's listener still up, then uvicorn stops.
"""

from app.server import LifespanApp

app = LifespanApp()
