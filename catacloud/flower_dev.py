"""Flower's settings for `make dev` (``celery flower --conf=catacloud/flower_dev.py``; tornado
runs this file as Python and takes the names it knows as options).

At start Flower asks the workers for their stats, queues, tasks and configuration; under
`make dev` it starts together with the worker, before any worker listens for the question, so
every start logged four ``Inspect method … failed`` warnings. Flower sees the worker anyway
from its events (the dev worker runs with ``-E``), and a refresh asks again. Its inspector's
warnings (no answer) are dropped; its errors (a failed inspection) still show.
"""

import logging as _logging  # not `logging`: that name is one of Flower's options

_logging.getLogger("flower.inspector").setLevel(_logging.ERROR)
