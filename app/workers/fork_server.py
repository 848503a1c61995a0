"""The first import of the fork server that front-end processes are forked from (VIT_WORKERS > 1).

The supervisor names this module in `set_forkserver_preload`; nothing else imports it. The fork server
leaves the supervisor's process group, as the engine and the front-ends do, so a signal to that group
(`kill %1` in a shell, `kill -- -PGID`) reaches the supervisor only, which stops the rest in order.
Then it imports the serving stack once, for every front-end forked from it.
"""

import os

import app.workers.supervisor  # noqa: F401  (imported for the front-ends forked from here)

os.setsid()
