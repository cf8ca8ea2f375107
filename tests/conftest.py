"""Shared by every test session, the xdist controller's included.

The controller rebuilds each warning a worker reports by importing the module of its
class (``overlapkit.overlap.core.watched_params`` for a ``ParameterReadInWindowWarning``),
in one thread per worker: two workers' overlapkit warnings arriving together had two
threads import ``overlapkit.overlap``, whose modules import each other, at once, and
the controller died of importlib's ``_DeadlockError`` (on 43f4742 too, with ``-n 2``
over test_window_state.py, test_window.py, test_schedulers.py and
test_checkpoint_safety.py). The modules that define overlapkit's warnings are imported
here, once, before any worker reports (``import overlapkit`` alone imports none).
"""

import overlapkit.integrations.requirements
import overlapkit.overlap  # noqa: F401
